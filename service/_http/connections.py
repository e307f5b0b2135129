"""The HTTP connections themselves: who is at the other end, how long they may idle, how many.

uvicorn's h11 protocol, with three additions made through its protocol-class
setting (``uvicorn.Config(http=...)``):

- **The caller's identity** rides in each request's scope
  (``scope["extensions"]["framewire.peer"]``): ``SO_PEERCRED`` on the Unix
  socket, the socket table's uid for loopback TCP (``peers``), looked up
  lazily, only for requests that need it.
- **A deadline for request headers.** uvicorn closes a connection idle between
  requests, but one that sends a byte and then dribbles its headers (or sends
  nothing at all after connecting) would be held forever. Each connection must
  complete a request's headers within ``idle_s`` of connecting or of its last
  response. Bodies have their own read timeout (``app.BodyGuard``).
- **A cap on connections**: past ``max_connections`` a new connection gets a
  503 ``too_many_connections`` and is closed, before the worker runs out of
  file descriptors.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import MutableMapping
from typing import Any

from framewire.service._access.peers import Peer, tcp_peer, unix_peer
from uvicorn.protocols.http.h11_impl import H11Protocol

PEER_KEY = "framewire.peer"


class PeerLookup:
    """The credentials of a connection's peer, found once and only when asked."""

    def __init__(self, sock: Any):
        self._sock = sock
        self._peer: Peer | None = None
        self._done = False

    def get(self) -> Peer | None:
        if not self._done:
            self._done = True
            if self._sock.family == socket.AF_UNIX:
                self._peer = unix_peer(self._sock)
            else:
                try:
                    self._peer = tcp_peer(self._sock.getpeername(), self._sock.getsockname())
                except OSError:
                    self._peer = None
        return self._peer


def peer_of(scope: MutableMapping[str, Any]) -> Peer | None:
    """The caller of a request, if its connection could tell."""
    lookup = (scope.get("extensions") or {}).get(PEER_KEY)
    return lookup.get() if isinstance(lookup, PeerLookup) else None


def _refusal(status: str, code: str, message: str) -> bytes:
    body = json.dumps({"error": message, "code": code}).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def protocol_class(idle_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the peer, the header deadline and the cap."""

    class Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._deadline: asyncio.TimerHandle | None = None
            self._lookup: PeerLookup | None = None
            app = self.app

            async def with_peer(scope: Any, receive: Any, send: Any) -> None:
                if scope["type"] == "http" and self._lookup is not None:
                    extensions = scope.get("extensions") or {}
                    scope["extensions"] = {**extensions, PEER_KEY: self._lookup}
                await app(scope, receive, send)

            self.app = with_peer

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            if len(self.connections) > max_connections:
                message = f"the worker serves {max_connections} connections at most"
                self.transport.write(
                    _refusal("503 Service Unavailable", "too_many_connections", message)
                )
                self.transport.close()
                return
            sock = transport.get_extra_info("socket")
            self._lookup = PeerLookup(sock) if sock is not None else None
            self._arm()

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(idle_s, self._deadline_passed)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _deadline_passed(self) -> None:
            self._deadline = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._waiting_for_headers():
                self._disarm()  # a request is being served; its body has its own timeout

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return Protocol
