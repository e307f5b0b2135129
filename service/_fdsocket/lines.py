"""The fd socket's framing: request lines in, with the descriptors sent beside them; replies
out, a length, a JSON header and at most one descriptor.

asyncio transports cannot carry ancillary data, so connections are plain
non-blocking sockets driven with ``recvmsg``/``sendmsg`` and the loop's
readiness callbacks.

Which line a descriptor belongs to: on Linux the ``recvmsg`` that returns
descriptors stops at the end of the bytes they were sent with, and may have
begun with earlier bytes. So descriptors belong to the line holding the *last*
byte that call returned. Every descriptor received is owned here until it is
handed out with its line, and closed if the connection ends first.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import socket
from collections.abc import Callable

from framewire.core.fdsocket import LENGTH
from framewire.core.wire import FdReply

MAX_LINE = 64 << 10
RECV_BYTES = 64 << 10
MAX_FDS = 4  # per recvmsg; more is a protocol error (the kernel closes the ones cut off)
MAX_PENDING_FDS = 16  # received and not yet handed out with a line


class ProtocolError(Exception):
    """The peer broke the framing (descriptors cut off, too many): the connection ends."""


class _TooLong:
    """What :class:`Requests` returns for a line over the limit."""


TOO_LONG = _TooLong()


class Requests:
    """Request lines (each at most ``limit`` bytes) and their descriptors, in order.

    A line over the limit is reported once, as soon as it passes the limit, and
    the rest of it is dropped unread into memory (its descriptors closed), so one
    bad request cannot grow a buffer.
    """

    def __init__(self, conn: socket.socket, limit: int = MAX_LINE):
        self.conn = conn
        self.limit = limit
        self._buf = bytearray()
        self._fds: list[tuple[int, list[int]]] = []  # (buffer position they belong at, fds)
        self._skipping = False

    async def next(
        self, timeout: float | None = None, *, idle_bound: bool = False
    ) -> tuple[bytes | _TooLong, list[int]] | None:
        """The next line (without its newline) or TOO_LONG, with its descriptors (now the
        caller's); None at the end of the connection, or when a line that has begun is not
        complete ``timeout`` seconds after its first byte (None: no bound).

        Waiting for a line's first byte has no bound: a connection idle between requests
        is a rank generating its next video, and it holds regions the worker must not drop
        under it (the connection cap bounds how many may wait). ``idle_bound`` puts that
        wait under ``timeout`` too (a peer that may not use the socket gets no idle slot).
        A line that has begun must end in time, so a peer that dribbles cannot hold its
        slot busy."""
        try:
            if not self._buf and not self._skipping:
                async with asyncio.timeout(timeout if idle_bound else None):
                    if not await self._receive():
                        return None
            async with asyncio.timeout(timeout):
                return await self._next()
        except TimeoutError:
            return None

    async def _next(self) -> tuple[bytes | _TooLong, list[int]] | None:
        while True:
            newline = self._buf.find(b"\n")
            if newline >= 0:
                line, fds = self._take(newline + 1)
                if self._skipping:
                    self._skipping = False
                    _close(fds)
                    continue
                if len(line) - 1 > self.limit:
                    _close(fds)
                    return TOO_LONG, []
                return line[:-1], fds
            if not self._skipping and len(self._buf) > self.limit:
                self._skipping = True
                _close(self._take(len(self._buf))[1])
                return TOO_LONG, []
            if self._skipping:
                _close(self._take(len(self._buf))[1])
            if not await self._receive():
                # A last request without its newline is still a request.
                if self._buf and not self._skipping:
                    return self._take(len(self._buf))
                return None

    def _take(self, n: int) -> tuple[bytes, list[int]]:
        """The first ``n`` buffered bytes and the descriptors that belong to them."""
        data = bytes(self._buf[:n])
        del self._buf[:n]
        mine = [fd for at, fds in self._fds if at < n for fd in fds]
        self._fds = [(at - n, fds) for at, fds in self._fds if at >= n]
        return data, mine

    async def _receive(self) -> bool:
        """Read once into the buffer; False at the end of the connection."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                data, ancillary, flags, _ = self.conn.recvmsg(
                    RECV_BYTES, socket.CMSG_SPACE(MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC
                )
                break
            except (BlockingIOError, InterruptedError):
                await _ready(loop, self.conn, loop.add_reader, loop.remove_reader)
        fds = _descriptors(ancillary)
        if flags & socket.MSG_CTRUNC:
            _close(fds)
            raise ProtocolError(f"more than {MAX_FDS} descriptors in one message")
        if fds:
            if not data or sum(len(f) for _, f in self._fds) + len(fds) > MAX_PENDING_FDS:
                _close(fds)
                raise ProtocolError("descriptors without requests to carry them")
            self._fds.append((len(self._buf) + len(data) - 1, fds))
        self._buf += data
        return bool(data)

    def close(self) -> None:
        """Close every descriptor still held (the connection is ending)."""
        for _, fds in self._fds:
            _close(fds)
        self._fds = []


def _descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
    return fds


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


async def send_reply(conn: socket.socket, reply: FdReply, fd: int | None = None) -> None:
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
            await _ready(loop, conn, loop.add_writer, loop.remove_writer)
            continue
        view = view[sent:]
        ancillary = []  # the fd travels with the first bytes only


async def _ready(
    loop: asyncio.AbstractEventLoop,
    conn: socket.socket,
    add: Callable[..., object],
    remove: Callable[[int], object],
) -> None:
    """Until ``conn`` is readable (``loop.add_reader``) or writable (``add_writer``)."""
    ready: asyncio.Future[None] = loop.create_future()
    fileno = conn.fileno()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    add(fileno, wake)
    try:
        await ready
    finally:
        remove(fileno)
