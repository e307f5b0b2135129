"""The client end of the fd socket: one JSON line out, a header and an fd back.

The protocol is described in docs/api.md ("The fd socket").
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import hashlib
import json
import os
import select
import socket
import struct
from pathlib import Path
from typing import Any

from framewire.core.beside import Beside
from framewire.core.closing import Closing
from framewire.core.errors import FramewireError, Unavailable, error_class, rebuild
from framewire.core.trust import check_dir, check_unix_peer, worker_uids
from framewire.core.wire import FdReply
from framewire.core.wire._fdsocket import MAX_TAKE_WAIT_S
from pydantic import ValidationError

LENGTH = struct.Struct(">I")
MAX_HEADER = 1 << 20
DEFAULT_TIMEOUT = 3600.0  # a long decode is legitimate; a dead worker shows up as EOF
REPLY_S = 60.0  # a take's reply once its output is held: one answer on a local socket


def runtime_dir() -> Path:
    """Where a worker puts its sockets by default: ``$XDG_RUNTIME_DIR/framewire``, else
    ``/tmp/framewire-<uid>`` (the worker's defaults and the client's agree by this)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "framewire" if xdg else Path(f"/tmp/framewire-{os.getuid()}")


def default_fd_socket() -> Path:
    """FRAMEWIRE_FD_SOCKET, else where a worker puts it by default (its runtime dir)."""
    configured = os.environ.get("FRAMEWIRE_FD_SOCKET")
    return Path(configured) if configured else runtime_dir() / "fd.sock"


def error_from(reply: FdReply) -> FramewireError:
    """The exception a failed reply stands for, carrying the worker's code."""
    code = reply.code or "decode_failed"
    message = reply.message or "the worker refused the request"
    return rebuild(
        error_class(fd_code=code), message, code=reply.reason or code, detail=reply.detail
    )


class ConnectionLost(Unavailable):
    """The connection broke under a request (the worker went away or closed it)."""


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


class FdSocket(Closing):
    """One connection to the worker's fd socket; requests go one at a time.

    Every way of not reaching the worker (no socket file, nobody listening, the
    worker dying mid-request) raises :class:`Unavailable`, which is what lets a
    caller fall back to a local decode. A socket in a directory that is not the
    worker's, or served by another user than the worker's (``worker_uid``:
    core.trust), is ``worker_not_trusted``, before anything is sent.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        timeout: float | None = DEFAULT_TIMEOUT,
        *,
        worker_uid: int | None = None,
    ):
        self.path = Path(path)
        uids = worker_uids(worker_uid)
        check_dir(self.path.parent, uids)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(os.fspath(self.path))
        except OSError as exc:
            self._sock.close()
            raise Unavailable(f"fd socket {self.path} unreachable: {exc}") from exc
        try:
            check_unix_peer(self._sock, uids, f"fd socket {self.path}")
        except BaseException:
            self._sock.close()
            raise

    def call(self, message: dict[str, Any], fd: int | None = None) -> tuple[FdReply, int | None]:
        """Send one request (with ``fd`` beside it, which stays the caller's); returns the
        reply header and the fd it carried (the caller owns it)."""
        fds: list[int] = []
        try:
            self._send(json.dumps(message, separators=(",", ":")).encode() + b"\n", fd)
            (length,) = LENGTH.unpack(self._recv_exactly(LENGTH.size, fds))
            if length > MAX_HEADER:
                raise FramewireError(f"reply header of {length} bytes", code="protocol")
            body = self._recv_exactly(length, fds)
            reply = FdReply.model_validate_json(body)
            if len(fds) > 1:
                raise FramewireError(f"reply carried {len(fds)} descriptors", code="protocol")
        except (OSError, EOFError) as exc:
            _close_all(fds)
            raise ConnectionLost(f"fd socket {self.path}: connection lost ({exc})") from exc
        except ValidationError as exc:
            _close_all(fds)
            raise FramewireError(f"malformed reply header: {exc}", code="protocol") from None
        except BaseException:
            _close_all(fds)
            raise
        return reply, (fds[0] if fds else None)

    def stale(self) -> bool:
        """Whether the worker has closed this connection (it restarted, or went away):
        seen without sending, so the caller can connect again before a request."""
        # An idle connection has nothing to read; readable means the end of it (or bytes
        # no request asked for). poll, not recv: a socket with a timeout waits in recv.
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        return bool(poller.poll(0))

    def _send(self, line: bytes, fd: int | None) -> None:
        if fd is None:
            self._sock.sendall(line)
            return
        # The whole line goes with the descriptor in one message: the worker gives a
        # descriptor to the line its message ends in.
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        sent = self._sock.sendmsg([line], rights)
        if sent < len(line):
            self._sock.sendall(line[sent:])

    def _recv_exactly(self, n: int, fds: list[int]) -> bytes:
        """``n`` bytes, collecting any descriptors that arrive with them into ``fds``."""
        buf = bytearray()
        while len(buf) < n:
            # MSG_CMSG_CLOEXEC: a received fd must not leak into children this process starts.
            data, ancillary, flags, _ = self._sock.recvmsg(
                n - len(buf), socket.CMSG_SPACE(4 * 4), socket.MSG_CMSG_CLOEXEC
            )
            for level, kind, cdata in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", cdata[: len(cdata) - len(cdata) % 4]))
            if flags & socket.MSG_CTRUNC:
                raise FramewireError("descriptors were truncated in transit", code="protocol")
            if not data:
                raise EOFError("the worker closed the connection")
            buf += data
        return bytes(buf)

    def close(self) -> None:
        self._sock.close()


def ping(
    path: str | os.PathLike[str] | None = None,
    timeout: float = 10.0,
    *,
    worker_uid: int | None = None,
) -> FdReply:
    """Ask the worker behind the fd socket whether it answers."""
    with FdSocket(path or default_fd_socket(), timeout, worker_uid=worker_uid) as conn:
        reply, fd = conn.call({"op": "ping"})
    if fd is not None:
        os.close(fd)
    if not reply.ok:
        raise error_from(reply)
    return reply


def take_output(
    ticket: str,
    path: str | os.PathLike[str] | None,
    timeout: float | None,
    *,
    worker_uid: int | None = None,
    sha256: str | None = None,
) -> bytes:
    """The bytes of the ``memory://`` output held under ``ticket`` (its result's
    ``handoff``), taken from the worker behind the fd socket; once per ticket.
    ``sha256``: the worker's for the output; bytes that do not have it raise
    (``output_mismatch``), hashed while they are read (:func:`_read_hashed`)."""
    fd, size = _taken(ticket, path, timeout, worker_uid, 0.0)
    try:
        if sha256 is None:
            return _read_whole(fd, size)
        data, digest = _read_hashed(fd, size)
    finally:
        os.close(fd)
    if digest != sha256:
        raise FramewireError(OTHER_BYTES, code=MISMATCH)
    return data


def take_hashed(
    ticket: str,
    path: str | os.PathLike[str] | None,
    timeout: float,
    *,
    worker_uid: int | None = None,
) -> tuple[bytes, str]:
    """The bytes of the ``memory://`` output reserved under ``ticket`` (a stream session's,
    named when it opened) and their sha256, taken as soon as the worker holds the file
    (waiting up to ``timeout`` for it): read while the worker still hashes it, to be
    checked against its sha256 once its answer comes."""
    fd, size = _taken(ticket, path, timeout + REPLY_S, worker_uid, timeout)
    try:
        return _read_hashed(fd, size)
    finally:
        os.close(fd)


def _taken(
    ticket: str,
    path: str | os.PathLike[str] | None,
    timeout: float | None,
    worker_uid: int | None,
    wait_s: float,
) -> tuple[int, int]:
    """The memfd held under ``ticket`` (the caller's to close) and its size."""
    message: dict[str, Any] = {"op": "take", "ticket": ticket}
    if wait_s > 0:
        message["wait_s"] = min(wait_s, MAX_TAKE_WAIT_S)
    with FdSocket(path or default_fd_socket(), timeout, worker_uid=worker_uid) as conn:
        reply, fd = conn.call(message)
    if fd is None:
        raise (
            error_from(reply)
            if not reply.ok
            else FramewireError("the take reply carried no descriptor", code="protocol")
        )
    try:
        size = os.fstat(fd).st_size
        if size != reply.byte_size:
            raise FramewireError(f"{size} bytes held, {reply.byte_size} announced", code="protocol")
    except BaseException:
        os.close(fd)
        raise
    return fd, size


def _read_whole(fd: int, size: int) -> bytes:
    """The ``size`` bytes of a sealed memfd (its size cannot change), read into the bytes
    returned: one copy, and none of its pages mapped here (a mapping's pages would count
    in this process's memory beside the bytes while they are copied). Most of the copy's
    time is the new pages' faults: huge pages for them (madvise) read 85 MB in 29-33 ms
    against 65-75, but a process's first such read took 37-244 ms: not used, a save's
    tail must not swing by that much."""
    data = os.pread(fd, size, 0)
    if len(data) == size:
        return data
    parts = [data]  # a read stops at about 2 GiB
    done = len(data)
    while done < size:
        part = os.pread(fd, size - done, done)
        if not part:
            message = f"the held output ended at {done} of {size} bytes"
            raise FramewireError(message, code="protocol")
        parts.append(part)
        done += len(part)
    return b"".join(parts)


# What makes a memfd's bytes final: no write, no size change, from anyone, ever.
SEALED = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
HASH_PIECE = 1 << 20
HASH_BESIDE = 16 << 20  # from here a thread hashing beside the copy shortens the take
MISMATCH = "output_mismatch"  # the code of a take whose bytes do not hash as reported
OTHER_BYTES = "the bytes the worker sent back do not have its sha256"


def _read_hashed(fd: int, size: int) -> tuple[bytes, str]:
    """:func:`_read_whole`, and the bytes' sha256. Past ``HASH_BESIDE`` bytes the memfd
    is hashed beside the copy, on another thread (both release the GIL: at 64 MiB, ~58
    ms against ~90 one after the other); the seals make what is hashed what is read, and
    a memfd without them is refused. A smaller one's bytes are hashed once read (a
    thread costs more than it saves there)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # not a memfd (nor any file that takes seals)
        seals = 0
    if seals & SEALED != SEALED:
        raise FramewireError("the held output is not sealed", code="protocol")
    if size < HASH_BESIDE:
        data = _read_whole(fd, size)
        return data, hashlib.sha256(data).hexdigest()

    def hashed() -> str:
        digest, piece = hashlib.sha256(), memoryview(bytearray(min(size, HASH_PIECE)))
        done = 0
        while n := os.preadv(fd, [piece[: size - done]], done):
            digest.update(piece[:n])
            done += n
        return digest.hexdigest()

    hashing = Beside(hashed, "framewire-take-sha256")
    try:
        data = _read_whole(fd, size)
    finally:
        hashing.join()  # bounded: a sealed memfd's pages; and it reads ``fd`` until then
    return data, hashing.result()  # a short memfd: the read above said so first
