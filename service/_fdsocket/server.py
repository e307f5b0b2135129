"""The fd socket (docs/api.md): reference decodes out, ranks' frames in, as descriptors.

A Unix stream socket served on the worker's event loop. A request is one JSON
line (with, for ``register``, exactly one descriptor beside it); a reply is a
4-byte big-endian length, a JSON header and, for a decode, exactly one fd in
SCM_RIGHTS. Requests on one connection are answered in order; connections are
served concurrently. The regions a connection registered are its own: they go
when it unregisters them or the connection closes (a rank that dies leaks
nothing), after the requests using them end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from framewire.client import __version__
from framewire.core.errors import FramewireError, NotFound
from framewire.core.wire import (
    DecodeRequest,
    FdRegister,
    FdReply,
    FdTake,
    FdUnregister,
    refusal,
)
from framewire.service._access.peers import Access, Peer, unix_peer
from framewire.service._access.peers import allowed as is_allowed
from framewire.service._decode.decoder import ReferenceDecoder
from framewire.service._fdsocket.lines import (
    MAX_LINE,
    ProtocolError,
    Requests,
    _TooLong,
    send_reply,
)
from framewire.service._ops.metrics import Metrics
from framewire.service._settings import Settings
from framewire.service._sockets import UnixListener, accept_forever
from framewire.service._sources.regions import FdRegion, RegionRegistry
from framewire.service._store.handoff import Handoffs
from pydantic import BaseModel, ValidationError

log = logging.getLogger("framewire.fdsocket")

OPS: dict[str, type[BaseModel] | None] = {
    "decode": DecodeRequest,
    "register": FdRegister,
    "unregister": FdUnregister,
    "take": FdTake,
    "ping": None,
}


def failure(
    code: str, message: str, detail: str | None = None, reason: str | None = None
) -> FdReply:
    return FdReply(ok=False, code=code, message=message, detail=detail, reason=reason)


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class _Connection:
    """One peer: who it is, and the regions it registered."""

    def __init__(self, peer: Peer | None):
        self.peer = peer
        self.access = Access(peer, trusted=False)
        # By name, but each the region object itself: the HTTP routes may unregister one,
        # and its name then be taken by another connection's region.
        self.regions: dict[str, FdRegion] = {}


@dataclass(eq=False)
class FdServer:
    settings: Settings
    decoder: ReferenceDecoder
    regions: RegionRegistry
    metrics: Metrics
    instance: str
    # memory:// outputs waiting to be taken.
    handoffs: Handoffs = field(default_factory=Handoffs)

    def __post_init__(self) -> None:
        self.path = Path(self.settings.fd_socket)
        self._listener: UnixListener | None = None
        self._owns_listener = False
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self, listener: UnixListener | None = None) -> None:
        """Serve on ``listener`` (the worker's), else on a socket bound here."""
        if listener is None:
            listener, self._owns_listener = UnixListener(self.path), True
        listener.sock.listen(128)
        self._listener = listener
        self._accepting = asyncio.create_task(
            accept_forever(listener.sock, self._accepted, "fd socket")
        )

    async def _accepted(self, conn: socket.socket) -> None:
        if len(self._connections) >= self.settings.max_connections:
            await self._refuse(conn)
            return
        conn.setblocking(False)
        task = asyncio.create_task(self._serve(conn))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _refuse(self, conn: socket.socket) -> None:
        """One ``overloaded`` reply, then the connection is closed."""
        self.metrics.fd_requests.labels("connect", "overloaded").inc()
        with contextlib.suppress(OSError):
            conn.setblocking(False)
            reply = failure(
                "overloaded",
                f"the fd socket serves {self.settings.max_connections} connections at most",
            )
            async with asyncio.timeout(1.0):
                await send_reply(conn, reply)
        conn.close()

    async def _serve(self, conn: socket.socket) -> None:
        requests = Requests(conn)
        state = _Connection(unix_peer(conn))
        try:
            allowed = is_allowed(state.peer, self.settings.allowed_uids, self.settings.allowed_gids)
            idle = self.settings.idle_timeout_s
            while (request := await requests.next(idle, idle_bound=not allowed)) is not None:
                line, fds = request
                try:
                    reply, fd, op = await self._answer(line, fds, state, allowed)
                finally:
                    _close(fds)  # whatever the answer did not take
                self.metrics.fd_requests.labels(op, reply.code or "ok").inc()
                try:
                    # A peer that does not read its replies is closed, not waited for.
                    async with asyncio.timeout(idle):
                        await send_reply(conn, reply, fd)
                finally:
                    if fd is not None:
                        os.close(fd)
                if not allowed:
                    break  # told once: a user who may not ask holds no connection
        except ProtocolError as exc:
            self.metrics.fd_requests.labels("invalid", "bad_request").inc()
            with contextlib.suppress(OSError):
                async with asyncio.timeout(1.0):
                    await send_reply(conn, failure("bad_request", str(exc)))
        except OSError:
            pass  # the peer went away, or read no reply within the idle timeout
        except Exception:
            log.exception("fd socket connection failed")
        finally:
            requests.close()
            conn.close()
            # A region in use is released once the requests using it end.
            for region in state.regions.values():
                self.regions.drop(region)

    async def _answer(
        self, line: bytes | _TooLong, fds: list[int], state: _Connection, allowed: bool
    ) -> tuple[FdReply, int | None, str]:
        """(reply, fd to send or None, op label). Never raises for a bad request; takes
        from ``fds`` (by emptying it) only what it keeps."""
        if not allowed:
            return failure("forbidden", "this user may not use the fd socket"), None, "denied"
        if isinstance(line, _TooLong):
            return failure("bad_request", f"request line over {MAX_LINE} bytes"), None, "invalid"
        try:
            message: Any = json.loads(line)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            # RecursionError: nesting deeper than the parser's stack, well within MAX_LINE
            return failure("bad_request", f"request is not JSON: {exc}"), None, "invalid"
        op = message.get("op") if isinstance(message, dict) else None
        if op not in OPS:
            names = ", ".join(f'"{o}"' for o in OPS)
            return failure("bad_request", f'request needs "op": one of {names}'), None, "invalid"
        wants = 1 if op == "register" else 0
        if len(fds) != wants:
            what = "exactly one descriptor" if wants else "no descriptor"
            return failure("bad_request", f"{op} takes {what}; got {len(fds)}"), None, op
        if op == "ping":
            pong = FdReply(ok=True, pong=True, message=f"framewire {__version__}")
            return pong.model_copy(update={"instance": self.instance}), None, op
        model = OPS[op]
        assert model is not None
        try:
            request = model.model_validate(message)
        except ValidationError as exc:
            return failure("bad_request", refusal(exc).message), None, op
        try:
            if isinstance(request, FdRegister):
                return self._register(request, fds, state), None, op
            if isinstance(request, FdUnregister):
                return self._unregister(request, state), None, op
            if isinstance(request, FdTake):
                assert state.peer is not None  # only allowed peers get here
                uid, wait_s = state.peer.uid, request.wait_s
                fd, size = await self.handoffs.take_when_held(request.ticket, uid, wait_s)
                return FdReply(ok=True, byte_size=size), fd, op
            assert isinstance(request, DecodeRequest)
            return await self._decode(request, state.access)
        except FramewireError as exc:
            return failure(exc.fd_code, exc.message, exc.detail, exc.code), None, op
        except Exception as exc:
            log.exception("fd socket %s failed", op)
            code = "decode_failed" if op == "decode" else "overloaded"
            return failure(code, f"internal error: {exc!r}", reason="internal"), None, op

    def _register(self, request: FdRegister, fds: list[int], state: _Connection) -> FdReply:
        fd = fds.pop()  # the registry's now (closed by it on failure too)
        assert state.peer is not None  # only allowed peers get here, and those are known
        region = self.regions.register_fd(
            request.name, fd, request.offset, request.byte_size, state.peer.uid
        )
        state.regions[region.name] = region
        return FdReply(ok=True, name=region.name, sealed=region.sealed)

    def _unregister(self, request: FdUnregister, state: _Connection) -> FdReply:
        region = state.regions.pop(request.name, None)
        if region is None:
            raise NotFound(
                f"this connection registered no region '{request.name}'",
                code="region_not_found",
            )
        self.regions.drop(region)  # at once; released when the requests using it end
        return FdReply(ok=True, name=request.name)

    async def _decode(
        self, request: DecodeRequest, access: Access
    ) -> tuple[FdReply, int | None, str]:
        answer = await self.decoder.decode(request, access)
        reply = FdReply(
            ok=True,
            frames=answer.frames,
            height=request.height,
            width=request.width,
            byte_size=answer.byte_size,
            cached=answer.cached,
            decode_ms=round(answer.decode_ms, 3),
        )
        return reply, answer.fd, "decode"

    async def stop_accepting(self) -> None:
        """Refuse new connections (a shutdown began); open ones are still answered.

        The socket file goes too, so a rank that asks now gets Unavailable at once
        and decodes locally.
        """
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
            self._accepting = None
        if self._listener is not None:
            # Only our own socket file: a newer worker may already have replaced it.
            if self._owns_listener:
                self._listener.close()
            else:
                self._listener.sock.close()
                self._listener.remove()
            self._listener = None

    async def close(self) -> None:
        """Stop accepting, drop connections, stop decodes, remove the socket file."""
        await self.stop_accepting()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.decoder.close()
