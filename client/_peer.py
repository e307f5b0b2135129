"""HTTP connections that reach the worker's user, checked before a byte is sent.

httpx sends its first request (and with it the bearer token) as soon as a
connection is made, so the check sits where connections are made: the network
backend of the transport's connection pool. Each new connection, on TCP or on
the Unix socket, is checked (core.trust); one that fails is closed, with
``worker_not_trusted``, before the pool writes anything to it.
"""

from __future__ import annotations

import functools
import socket
import ssl
from pathlib import Path
from typing import Any

import httpcore
import httpx
from framewire.core.trust import check_dir, check_tcp_peer, check_unix_peer


class PeerCheck:
    """What a new connection must be: a worker of ``uids``; on another host, let through
    only when ``remote_ok`` (https, no token to give away, or the caller said so)."""

    def __init__(
        self, uids: frozenset[int], remote_ok: bool, limits: httpx.Limits, tls: ssl.SSLContext
    ):
        self.uids = uids
        self.remote_ok = remote_ok
        self.limits = limits  # the pool's, as httpx would give its own transport
        self.tls = tls  # tls_for(url)

    def before_unix(self, path: str) -> None:
        check_dir(Path(path).parent, self.uids)

    def check(self, stream: Any, where: str | None) -> None:
        """Check a new connection (``where``: its socket path, None for TCP)."""
        sock: socket.socket = stream.get_extra_info("socket")
        if where is not None:
            check_unix_peer(sock, self.uids, f"HTTP socket {where}")
        else:
            check_tcp_peer(sock, self.uids, self.remote_ok)

    def transport(self, uds: str | None) -> httpx.HTTPTransport:
        made = httpx.HTTPTransport(uds=uds, limits=self.limits, verify=self.tls)
        pool = made._pool
        pool._network_backend = _Checked(pool._network_backend, self)
        return made

    def async_transport(self, uds: str | None) -> httpx.AsyncHTTPTransport:
        made = httpx.AsyncHTTPTransport(uds=uds, limits=self.limits, verify=self.tls)
        pool = made._pool
        pool._network_backend = _AsyncChecked(pool._network_backend, self)
        return made


def tls_for(url: str) -> ssl.SSLContext:
    """The TLS context of the transports of a client of ``url``. An https worker's is
    httpx's own verifying one (certifi, or SSL_CERT_FILE / SSL_CERT_DIR), made once per
    process: httpx would make one for every transport, and loading the CA bundle costs
    20-40 ms of CPU. A worker at http:// or unix:// is spoken to in plain HTTP, every
    request a path on it, so its context is never used: it gets one that verifies and
    trusts no certificate, which loads nothing and could accept no TLS connection."""
    if url.startswith("https://"):
        return _verifying()
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


@functools.cache
def _verifying() -> ssl.SSLContext:
    return httpx.create_ssl_context()  # safe to share between threads and connections


class _Checked(httpcore.NetworkBackend):
    """The pool's own backend: each connection it makes is checked before it is used."""

    def __init__(self, inner: httpcore.NetworkBackend, peer: PeerCheck):
        self._inner, self._peer = inner, peer

    def connect_tcp(self, host: str, port: int, *args: Any, **kw: Any) -> httpcore.NetworkStream:
        return self._checked(self._inner.connect_tcp(host, port, *args, **kw), None)

    def connect_unix_socket(self, path: str, *args: Any, **kw: Any) -> httpcore.NetworkStream:
        self._peer.before_unix(path)
        return self._checked(self._inner.connect_unix_socket(path, *args, **kw), path)

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)

    def _checked(self, stream: httpcore.NetworkStream, where: str | None) -> httpcore.NetworkStream:
        try:
            self._peer.check(stream, where)
        except BaseException:
            stream.close()
            raise
        return stream


class _AsyncChecked(httpcore.AsyncNetworkBackend):
    """:class:`_Checked` for the async pool."""

    def __init__(self, inner: httpcore.AsyncNetworkBackend, peer: PeerCheck):
        self._inner, self._peer = inner, peer

    async def connect_tcp(
        self, host: str, port: int, *args: Any, **kw: Any
    ) -> httpcore.AsyncNetworkStream:
        return await self._checked(await self._inner.connect_tcp(host, port, *args, **kw), None)

    async def connect_unix_socket(
        self, path: str, *args: Any, **kw: Any
    ) -> httpcore.AsyncNetworkStream:
        self._peer.before_unix(path)
        stream = await self._inner.connect_unix_socket(path, *args, **kw)
        return await self._checked(stream, path)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)

    async def _checked(
        self, stream: httpcore.AsyncNetworkStream, where: str | None
    ) -> httpcore.AsyncNetworkStream:
        try:
            # A few stat calls and one sock_diag question: short enough for the event loop.
            self._peer.check(stream, where)
        except BaseException:
            await stream.aclose()
            raise
        return stream
