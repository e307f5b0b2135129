"""HTTP connections that reach the worker's user, checked before a byte is sent.

httpx sends its first request (and with it the bearer token) as soon as a
connection is made, so the check sits where connections are made: the network
backend of the transport's connection pool. Each new connection, on TCP or on
the Unix socket, is checked (core.trust); one that fails is closed, with
``worker_not_trusted``, before the pool writes anything to it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpcore
import httpx
from framewire.core.trust import check_dir, check_tcp_peer, check_unix_peer

SocketOptions = Iterable[Any] | None


class PeerCheck:
    """What a new connection must be: a worker of ``uids``; on another host, let through
    only when ``remote_ok`` (https, no token to give away, or the caller said so)."""

    def __init__(self, uids: frozenset[int], remote_ok: bool, limits: httpx.Limits):
        self.uids = uids
        self.remote_ok = remote_ok
        self.limits = limits  # the pool's, as httpx would give its own transport

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
        made = httpx.HTTPTransport(uds=uds, limits=self.limits)
        pool = made._pool
        pool._network_backend = _Checked(pool._network_backend, self)
        return made

    def async_transport(self, uds: str | None) -> httpx.AsyncHTTPTransport:
        made = httpx.AsyncHTTPTransport(uds=uds, limits=self.limits)
        pool = made._pool
        pool._network_backend = _AsyncChecked(pool._network_backend, self)
        return made


class _Checked(httpcore.NetworkBackend):
    def __init__(self, inner: httpcore.NetworkBackend, peer: PeerCheck):
        self._inner, self._peer = inner, peer

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: SocketOptions = None,
    ) -> httpcore.NetworkStream:
        stream = self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        return _checked(stream, self._peer, None)

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: SocketOptions = None
    ) -> httpcore.NetworkStream:
        self._peer.before_unix(path)
        stream = self._inner.connect_unix_socket(path, timeout, socket_options)
        return _checked(stream, self._peer, path)

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def _checked(
    stream: httpcore.NetworkStream, peer: PeerCheck, where: str | None
) -> httpcore.NetworkStream:
    try:
        peer.check(stream, where)
    except BaseException:
        stream.close()
        raise
    return stream


class _AsyncChecked(httpcore.AsyncNetworkBackend):
    def __init__(self, inner: httpcore.AsyncNetworkBackend, peer: PeerCheck):
        self._inner, self._peer = inner, peer

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: SocketOptions = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        return await _async_checked(stream, self._peer, None)

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: SocketOptions = None
    ) -> httpcore.AsyncNetworkStream:
        self._peer.before_unix(path)
        stream = await self._inner.connect_unix_socket(path, timeout, socket_options)
        return await _async_checked(stream, self._peer, path)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


async def _async_checked(
    stream: httpcore.AsyncNetworkStream, peer: PeerCheck, where: str | None
) -> httpcore.AsyncNetworkStream:
    try:
        # A few stat calls and a read of /proc/net/tcp: short enough for the event loop.
        peer.check(stream, where)
    except BaseException:
        await stream.aclose()
        raise
    return stream
