"""The tests' own HTTP requests (httpx), with one TLS context for them all.

httpx makes a verifying TLS context for every client and transport, loading its CA
bundle each time: 20-40 ms of CPU. The suite makes thousands of clients, to plain HTTP
on loopback and to Unix sockets, where TLS is never spoken."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

TLS = httpx.create_ssl_context()


def http_client(base_url: str = "", *, uds: str | Path | None = None, **kw: Any) -> httpx.Client:
    """``httpx.Client(base_url, **kw)``; on the Unix socket ``uds`` if one is named."""
    transport = None if uds is None else httpx.HTTPTransport(uds=str(uds), verify=TLS)
    return httpx.Client(base_url=base_url, transport=transport, verify=TLS, **kw)


def http_get(url: str, **kw: Any) -> httpx.Response:
    """``httpx.get(url, **kw)``."""
    return httpx.get(url, verify=TLS, **kw)
