"""The tests' own HTTP requests (httpx), with one TLS context for them all.

httpx makes a verifying TLS context for every client and transport, loading its CA
bundle each time: 20-40 ms of CPU, where the suite makes thousands of clients. The
suite speaks plain HTTP only (loopback, Unix sockets), so its context is one that
verifies and trusts no certificate: it loads nothing, and no TLS connection would pass.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpx

TLS = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


def http_client(base_url: str = "", *, uds: str | Path | None = None, **kw: Any) -> httpx.Client:
    """``httpx.Client(base_url, **kw)``; on the Unix socket ``uds`` if one is named."""
    transport = None if uds is None else httpx.HTTPTransport(uds=str(uds), verify=TLS)
    return httpx.Client(base_url=base_url, transport=transport, verify=TLS, **kw)


def http_get(url: str, **kw: Any) -> httpx.Response:
    """``httpx.get(url, **kw)``."""
    return httpx.get(url, verify=TLS, **kw)
