"""Listening sockets and the uvicorn server that serves the app on them."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from types import FrameType

import uvicorn

from .settings import Settings


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
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class Server(uvicorn.Server):
    """uvicorn, except that a SIGTERM/SIGINT that shut it down gracefully exits with status 0.

    uvicorn re-raises the signal after shutdown; for a supervised worker a
    graceful stop is success, and orchestrators read a signal death as a crash.
    """

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


def serve(app: object, settings: Settings) -> None:
    sockets = [bind_tcp(settings.host, settings.port), bind_unix(settings.uds)]
    server = Server(uvicorn.Config(app, log_level=settings.log_level, lifespan="on"))  # type: ignore[arg-type]
    try:
        server.run(sockets=sockets)
    finally:
        for sock in sockets:
            sock.close()
        settings.uds.unlink(missing_ok=True)
