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
- **Answers that are not read.** A peer that stops reading (pipelined
  requests whose answers pile up) stalls the answer being written; a
  connection whose writes stay paused for ``idle_s`` is closed.
- **A cap on connections**: past ``max_connections`` a new connection gets a
  503 ``too_many_connections`` and is closed, before the worker runs out of
  file descriptors. A quarter of them is kept for the ranks: connections on
  the Unix socket from an allowed user (``allowed``) may take every slot,
  any other (TCP, another user) only the rest, so nobody who merely reaches
  the port can lock the ranks out.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable, MutableMapping
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


def reserved_for_ranks(max_connections: int) -> int:
    """Slots only the Unix socket's allowed peers may take."""
    return max_connections // 4


def protocol_class(
    idle_s: float, max_connections: int, allowed: Callable[[Peer | None], bool]
) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the peer, the deadlines and the cap."""
    others = max_connections - reserved_for_ranks(max_connections)

    class Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._deadline: asyncio.TimerHandle | None = None
            self._stalled: asyncio.TimerHandle | None = None
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
            sock = transport.get_extra_info("socket")
            self._lookup = PeerLookup(sock) if sock is not None else None
            held = len(self.connections)  # this one's included
            if held > max_connections or (held > others and not self._a_rank(sock)):
                message = (
                    f"the worker serves {max_connections} connections at most, "
                    f"{max_connections - others} of them kept for its ranks' Unix socket"
                )
                self.transport.write(
                    _refusal("503 Service Unavailable", "too_many_connections", message)
                )
                self.transport.close()
                return
            self._arm()

        def _a_rank(self, sock: Any) -> bool:
            """A connection that may take a reserved slot: a rank on the Unix socket."""
            if self._lookup is None:
                return False
            return sock.family == socket.AF_UNIX and allowed(self._lookup.get())

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stalled is None:
                self._stalled = self.loop.call_later(idle_s, self._abort)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._stalled is not None:
                self._stalled.cancel()
                self._stalled = None

        def _abort(self) -> None:
            self._stalled = None
            self.transport.abort()  # what is buffered for a peer that does not read goes

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
            if self._stalled is not None:
                self._stalled.cancel()
                self._stalled = None
            super().connection_lost(exc)

    return Protocol
