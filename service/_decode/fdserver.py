"""The fd socket (docs/api.md): reference decodes answered with a sealed memfd.

A Unix stream socket served on the worker's event loop. A request is one JSON
line; a reply is a 4-byte big-endian length, a JSON header and, for a decode,
exactly one fd in SCM_RIGHTS. asyncio transports cannot carry ancillary data,
so connections are plain non-blocking sockets driven with the loop's
``sock_*`` calls and ``sendmsg``. Requests on one connection are answered in
order; connections are served concurrently.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

from framewire.client import __version__
from framewire.client._errors import (
    FramewireError,
)
from framewire.client._fdsocket import LENGTH
from framewire.client.wire import DecodeReply, DecodeRequest, refusal
from framewire.service._access.peers import Access, Peer, unix_peer
from framewire.service._decode.decoder import ReferenceDecoder
from framewire.service._ops.metrics import Metrics
from framewire.service._settings import Settings
from framewire.service._sockets import UnixListener
from pydantic import ValidationError

log = logging.getLogger("framewire.fdserver")

MAX_LINE = 64 << 10
RECV_BYTES = 64 << 10
ACCEPT_BACKOFF_S = (0.05, 1.0)  # after a failed accept (EMFILE): first and longest pause


def failure(code: str, message: str, detail: str | None = None) -> DecodeReply:
    return DecodeReply(ok=False, code=code, message=message, detail=detail)


class _TooLong:
    """What :class:`LineReader` returns for a line over the limit."""


TOO_LONG = _TooLong()


class LineReader:
    """Request lines from a non-blocking socket, each at most ``limit`` bytes.

    A longer line is reported once, as soon as it passes the limit, and the rest
    of it is dropped unread into memory, so one bad request cannot grow a buffer.
    """

    def __init__(self, conn: socket.socket, limit: int = MAX_LINE):
        self.conn = conn
        self.limit = limit
        self._buf = bytearray()
        self._skipping = False

    async def next(self, timeout: float | None = None) -> bytes | _TooLong | None:
        """The next line (without its newline), TOO_LONG, or None at the end.

        The whole line must arrive within ``timeout`` seconds (None: no bound), so
        a peer that sends nothing, or dribbles a line, cannot hold the connection.
        """
        try:
            async with asyncio.timeout(timeout):
                return await self._next()
        except TimeoutError:
            return None

    async def _next(self) -> bytes | _TooLong | None:
        loop = asyncio.get_running_loop()
        while True:
            newline = self._buf.find(b"\n")
            if newline >= 0:
                line = bytes(self._buf[:newline])
                del self._buf[: newline + 1]
                if self._skipping:
                    self._skipping = False
                    continue
                if len(line) > self.limit:
                    return TOO_LONG
                return line
            if not self._skipping and len(self._buf) > self.limit:
                self._skipping = True
                self._buf.clear()
                return TOO_LONG
            if self._skipping:
                self._buf.clear()
            data = await loop.sock_recv(self.conn, RECV_BYTES)
            if not data:
                # A last request without its newline is still a request.
                if self._buf and not self._skipping:
                    line, self._buf = bytes(self._buf), bytearray()
                    return line
                return None
            self._buf += data


async def send_reply(conn: socket.socket, reply: DecodeReply, fd: int | None = None) -> None:
    """Length, header and (with the first bytes) the fd, on a non-blocking socket."""
    body = reply.model_dump_json(exclude_none=True).encode()
    view = memoryview(LENGTH.pack(len(body)) + body)
    ancillary = []
    if fd is not None:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
    loop = asyncio.get_running_loop()
    while view:
        try:
            sent = conn.sendmsg([view], ancillary)
        except (BlockingIOError, InterruptedError):
            await _writable(loop, conn)
            continue
        view = view[sent:]
        ancillary = []  # the fd travels with the first bytes only


async def _writable(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()
    fileno = conn.fileno()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_writer(fileno, wake)
    try:
        await ready
    finally:
        loop.remove_writer(fileno)


class FdServer:
    def __init__(self, settings: Settings, decoder: ReferenceDecoder, metrics: Metrics):
        self.settings = settings
        self.decoder = decoder
        self.metrics = metrics
        self.path = Path(settings.fd_socket)
        self._listener: UnixListener | None = None
        self._owns_listener = False
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self, listener: UnixListener | None = None) -> None:
        """Serve on ``listener`` (the worker's), else on a socket bound here."""
        if listener is None:
            listener, self._owns_listener = UnixListener(self.path), True
        listener.sock.listen(128)
        listener.sock.setblocking(False)
        self._listener = listener
        self._accepting = asyncio.create_task(self._accept_loop(listener.sock))

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        backoff = ACCEPT_BACKOFF_S[0]
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS: wait for fds to free up
                if backoff == ACCEPT_BACKOFF_S[0]:
                    log.warning("fd socket: cannot accept a connection (%s); backing off", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, ACCEPT_BACKOFF_S[1])
                continue
            backoff = ACCEPT_BACKOFF_S[0]
            if len(self._connections) >= self.settings.max_connections:
                await self._refuse(conn)
                continue
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

    def _allowed(self, peer: Peer | None) -> bool:
        if peer is None:
            return False
        groups = peer.gids
        return peer.uid in self.settings.allowed_uids or any(
            g in self.settings.allowed_gids for g in groups
        )

    async def _serve(self, conn: socket.socket) -> None:
        try:
            peer = unix_peer(conn)
            allowed = self._allowed(peer)
            access = Access(peer, trusted=False)
            lines = LineReader(conn)
            idle = self.settings.idle_timeout_s
            while (line := await lines.next(idle)) is not None:
                reply, fd, op = await self._answer(line, allowed, access)
                self.metrics.fd_requests.labels(op, reply.code or "ok").inc()
                try:
                    await send_reply(conn, reply, fd)
                finally:
                    if fd is not None:
                        os.close(fd)
        except OSError:
            pass  # the peer went away; nothing to answer
        except Exception:
            log.exception("fd socket connection failed")
        finally:
            conn.close()

    async def _answer(
        self, line: bytes | _TooLong, allowed: bool, access: Access
    ) -> tuple[DecodeReply, int | None, str]:
        """(reply, fd to send or None, op label). Never raises for a bad request."""
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
        if op not in ("decode", "ping"):
            return failure("bad_request", 'request needs "op": "decode" or "ping"'), None, "invalid"
        if op == "ping":
            return DecodeReply(ok=True, pong=True, message=f"framewire {__version__}"), None, op
        try:
            request = DecodeRequest.model_validate(message)
        except ValidationError as exc:
            return failure("bad_request", refusal(exc).message), None, op
        try:
            answer = await self.decoder.decode(request, access)
        except FramewireError as exc:
            return failure(exc.fd_code, exc.message, exc.detail), None, op
        except Exception as exc:
            log.exception("reference decode of %s failed", request.path)
            return failure("decode_failed", f"internal error: {exc!r}"), None, op
        reply = DecodeReply(
            ok=True,
            frames=answer.frames,
            height=request.height,
            width=request.width,
            byte_size=answer.byte_size,
            cached=answer.cached,
            decode_ms=round(answer.decode_ms, 3),
        )
        return reply, answer.fd, op

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
