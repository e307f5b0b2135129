"""The worker's listening sockets, bound before anything else starts.

A worker owns its socket files while it runs. Each Unix socket has a lock file
beside it (``<socket>.lock``, ``flock``-ed for the worker's life, released by
the kernel when it dies), so a second worker started on the same paths refuses
to start and leaves the running one untouched. A socket file left by a worker
that was killed is replaced; at exit a worker removes only the socket files it
made itself.

The directory of each socket must be the worker's own (core.trust): another
user's (``/tmp/framewire-<uid>`` made first by someone else, say), or one every
user may write to, could hand the worker's clients to whoever renames a socket
over the worker's, or plant the lock. The worker refuses to start there, naming
the directory; it never follows a link to open a lock file, nor uses one that is
another user's.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

from framewire.core.closing import Closing
from framewire.core.trust import unsafe_dir
from framewire.service._settings import Settings

log = logging.getLogger("framewire.sockets")

ACCEPT_BACKOFF_S = (0.05, 1.0)  # after a failed accept (EMFILE): first and longest pause


async def accept_forever(
    listener: socket.socket, serve: Callable[[socket.socket], Awaitable[None]], what: str
) -> None:
    """Hand each connection ``listener`` accepts to ``serve``, until cancelled.

    When an accept fails (no descriptor left: EMFILE, ENFILE; ENOBUFS) the loop waits,
    twice as long each time up to a second, and says so once: a worker out of
    descriptors neither spins nor floods its log. Every listener of the worker, HTTP
    and fd socket, accepts here.
    """
    loop = asyncio.get_running_loop()
    listener.setblocking(False)
    backoff = ACCEPT_BACKOFF_S[0]
    while True:
        try:
            conn, _ = await loop.sock_accept(listener)
        except OSError as exc:
            if backoff == ACCEPT_BACKOFF_S[0]:
                log.warning("%s: cannot accept a connection (%s); backing off", what, exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, ACCEPT_BACKOFF_S[1])
            continue
        backoff = ACCEPT_BACKOFF_S[0]
        await serve(conn)


class CannotServe(RuntimeError):
    """A socket this worker was asked to serve is not to be served by it."""


class AlreadyServed(CannotServe):
    """Another worker serves a socket this one was asked to serve."""


class NotOwnDirectory(CannotServe):
    """A socket's directory, or its lock file, is not the worker's own."""


def _own_uids() -> frozenset[int]:
    return frozenset({os.geteuid(), 0})


def _open_lock(path: Path) -> int:
    """The lock file beside the socket at ``path``: never through a link, and the
    worker's own (or root's)."""
    lock = f"{path}.lock"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotOwnDirectory(f"{lock} is a symbolic link") from None
        raise
    owner = os.fstat(fd).st_uid
    if owner not in _own_uids():
        os.close(fd)
        raise NotOwnDirectory(f"{lock} belongs to uid {owner}")
    return fd


def _answers(path: Path) -> bool:
    """Whether something listens on the socket at ``path`` (a live worker, not a stale file)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(os.fspath(path))
        except OSError:
            return False
    return True


class UnixListener(Closing):
    """A bound Unix stream socket at ``path`` (mode ``mode``), held under its lock file."""

    def __init__(self, path: Path, mode: int = 0o660):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        unsafe = unsafe_dir(path.parent, _own_uids())
        if unsafe is not None:
            raise NotOwnDirectory(f"{unsafe}, so its sockets could be anyone's")
        self._lock = _open_lock(path)
        try:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held = f"another worker serves {path} (it holds {path}.lock)"
                raise AlreadyServed(held) from None
            if path.is_socket() and _answers(path):  # a worker that takes no lock
                raise AlreadyServed(f"another worker answers on {path}")
            if path.is_socket():
                path.unlink()  # left by a worker that was killed
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.sock.bind(str(path))
                os.chmod(path, mode)
                self._inode = os.stat(path).st_ino
            except BaseException:
                self.sock.close()
                raise
        except BaseException:
            os.close(self._lock)
            raise

    def remove(self) -> None:
        """Unlink the socket file, if it is still the one bound here (idempotent)."""
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self._inode:
                self.path.unlink()

    def close(self) -> None:
        self.sock.close()
        self.remove()
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1


def bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so, and
    # without it each answer on a kept-alive connection waits ~40 ms for delayed ACKs.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


class Listeners(Closing):
    """The worker's three sockets, bound before anything else starts (or none at all)."""

    def __init__(self, settings: Settings):
        with contextlib.ExitStack() as undo:
            # TCP first: a port in use fails the start before any socket file is touched.
            self.tcp = bind_tcp(settings.host, settings.port)
            undo.callback(self.tcp.close)
            self.api = UnixListener(Path(settings.uds))
            undo.callback(self.api.close)
            self.fd = UnixListener(Path(settings.fd_socket))
            undo.pop_all()

    @property
    def http(self) -> list[socket.socket]:
        return [self.tcp, self.api.sock]

    def close(self) -> None:
        self.tcp.close()
        self.api.close()
        self.fd.close()
