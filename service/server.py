"""Listening sockets and the uvicorn server that serves the app on them.

A worker owns its socket files while it runs. Each Unix socket has a lock file
beside it (``<socket>.lock``, ``flock``-ed for the worker's life, released by
the kernel when it dies), so a second worker started on the same paths refuses
to start and leaves the running one untouched. A socket file left by a worker
that was killed is replaced; at exit a worker removes only the socket files it
made itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType

import uvicorn
from uvicorn.config import LOG_LEVELS

from .connections import protocol_class
from .logs import configure_logging
from .settings import Settings

DrainHook = Callable[[], Awaitable[None]]


class AlreadyServed(RuntimeError):
    """Another worker serves a socket this one was asked to serve."""


def _answers(path: Path) -> bool:
    """Whether something listens on the socket at ``path`` (a live worker, not a stale file)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(os.fspath(path))
        except OSError:
            return False
    return True


class UnixListener:
    """A bound Unix stream socket at ``path`` (mode ``mode``), held under its lock file."""

    def __init__(self, path: Path, mode: int = 0o660):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        self._lock = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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


class Listeners:
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


class StopSignals:
    """SIGTERM and SIGINT handlers for the whole life of ``serve``, uvicorn's run apart.

    uvicorn re-raises a signal it handled, once it has shut down, to the handler
    that was in place before it started: that is this one, which only takes note,
    so a graceful stop exits with status 0 (orchestrators read a signal death as a
    crash). A signal that arrives before uvicorn runs (while the app is built)
    makes it stop as soon as it has started.
    """

    def __init__(self) -> None:
        self.requested = False
        self.server: uvicorn.Server | None = None
        self._previous: dict[int, object] = {}

    def _note(self, sig: int, frame: FrameType | None) -> None:
        self.requested = True
        if self.server is not None:
            self.server.should_exit = True

    def __enter__(self) -> StopSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def watch(self, server: uvicorn.Server) -> None:
        self.server = server
        if self.requested:
            server.should_exit = True


class Server(uvicorn.Server):
    """uvicorn, with ``on_drain`` run first when a shutdown begins.

    Listeners uvicorn does not own stop accepting too; uvicorn then waits up to
    the config's ``timeout_graceful_shutdown`` for requests in flight and cancels
    the rest.
    """

    def __init__(self, config: uvicorn.Config, on_drain: DrainHook | None = None):
        super().__init__(config)
        self.on_drain = on_drain

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.on_drain is not None:
            await self.on_drain()
        await super().shutdown(sockets)


def uvicorn_config(app: object, settings: Settings) -> uvicorn.Config:
    level = LOG_LEVELS[settings.log_level.lower()]
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        log_level=level,
        log_config=None,  # configure_logging did it: one format for every logger
        lifespan="on",
        http=protocol_class(settings.idle_timeout_s, settings.max_connections),
        timeout_graceful_shutdown=settings.shutdown_grace,  # type: ignore[arg-type]
    )


AppFactory = Callable[[Listeners], tuple[object, DrainHook]]


def serve(settings: Settings, build: AppFactory) -> None:
    """Bind every socket, build the app on them (``build``), serve until a signal."""
    configure_logging(settings.log_format, LOG_LEVELS[settings.log_level.lower()])
    with StopSignals() as stop:
        listeners = Listeners(settings)
        try:
            app, on_drain = build(listeners)
            server = Server(uvicorn_config(app, settings), on_drain)
            stop.watch(server)
            server.run(sockets=listeners.http)
        finally:
            listeners.close()
