"""Listening sockets and the uvicorn server that serves the app on them."""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType

import uvicorn
from uvicorn.config import LOG_LEVELS

from .logs import configure_logging
from .settings import Settings

DrainHook = Callable[[], Awaitable[None]]


def bind_unix(path: Path, mode: int = 0o660) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    if path.is_socket():
        path.unlink()  # left by a worker that was killed
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, mode)
    return sock


def bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so, and
    # without it each answer on a kept-alive connection waits ~40 ms for delayed ACKs.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class Server(uvicorn.Server):
    """uvicorn, except that a SIGTERM/SIGINT that shut it down gracefully exits with status 0.

    uvicorn re-raises the signal after shutdown; for a supervised worker a
    graceful stop is success, and orchestrators read a signal death as a crash.
    ``on_drain`` runs first when a shutdown begins (listeners uvicorn does not
    own stop accepting too); uvicorn then waits up to the config's
    ``timeout_graceful_shutdown`` for requests in flight and cancels the rest.
    """

    def __init__(self, config: uvicorn.Config, on_drain: DrainHook | None = None):
        super().__init__(config)
        self.on_drain = on_drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.on_drain is not None:
            await self.on_drain()
        await super().shutdown(sockets)


def serve(app: object, settings: Settings, *, on_drain: DrainHook | None = None) -> None:
    level = LOG_LEVELS[settings.log_level.lower()]
    configure_logging(settings.log_format, level)
    sockets = [bind_tcp(settings.host, settings.port), bind_unix(settings.uds)]
    config = uvicorn.Config(
        app,  # type: ignore[arg-type]
        log_level=level,
        log_config=None,  # configure_logging did it: one format for every logger
        lifespan="on",
        timeout_graceful_shutdown=settings.shutdown_grace,  # type: ignore[arg-type]
    )
    server = Server(config, on_drain)
    try:
        server.run(sockets=sockets)
    finally:
        for sock in sockets:
            sock.close()
        settings.uds.unlink(missing_ok=True)
