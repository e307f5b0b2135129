"""The uvicorn server the worker runs its app on, and the signals that stop it."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn
from framewire.service._access.peers import allowed
from framewire.service._http.connections import protocol_class
from framewire.service._settings import Settings
from framewire.service._sockets import accept_forever
from uvicorn.config import LOG_LEVELS

DrainHook = Callable[[], Awaitable[None]]


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
    """uvicorn, accepting through the worker's own loop, with ``on_drain`` run first when
    a shutdown begins.

    Connections are accepted by ``accept_forever``, as on the fd socket, and handed to
    uvicorn's protocol: asyncio's own servers, out of descriptors, log a traceback for
    every pending connection and try again at once. On shutdown, listeners uvicorn does
    not own stop accepting too; uvicorn then waits up to the config's
    ``timeout_graceful_shutdown`` for requests in flight and cancels the rest.
    """

    def __init__(self, config: uvicorn.Config, on_drain: DrainHook | None = None):
        super().__init__(config)
        self.on_drain = on_drain
        self._accepting: list[asyncio.Task[None]] = []

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=[])  # the lifespan, and no asyncio server
        for sock in sockets or []:
            sock.listen(self.config.backlog)
            what = "HTTP (Unix socket)" if sock.family == socket.AF_UNIX else "HTTP"
            self._accepting.append(asyncio.create_task(accept_forever(sock, self._connect, what)))

    async def _connect(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        config = self.config
        protocol = config.http_protocol_class(  # type: ignore[call-arg]
            config=config, server_state=self.server_state, app_state=self.lifespan.state
        )
        try:
            await loop.connect_accepted_socket(lambda: protocol, conn)
        except OSError:
            conn.close()

    async def _stop_accepting(self) -> None:
        for task in self._accepting:
            task.cancel()
        await asyncio.gather(*self._accepting, return_exceptions=True)
        self._accepting = []

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self._stop_accepting()
        if self.on_drain is not None:
            started = time.monotonic()
            await self.on_drain()
            # One grace period in all: what the drain took comes off uvicorn's wait.
            grace = self.config.timeout_graceful_shutdown
            if grace is not None:
                left = max(0.0, grace - (time.monotonic() - started))
                self.config.timeout_graceful_shutdown = left  # type: ignore[assignment]
        await super().shutdown(sockets)


def uvicorn_config(app: object, settings: Settings) -> uvicorn.Config:
    level = LOG_LEVELS[settings.log_level.lower()]
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        log_level=level,
        log_config=None,  # configure_logging did it: one format for every logger
        lifespan="on",
        http=protocol_class(
            settings.idle_timeout_s,
            settings.max_connections,
            lambda peer: allowed(peer, settings.allowed_uids, settings.allowed_gids),
        ),
        # Idle keep-alive connections are closed by the header deadline (idle_timeout_s),
        # not sooner: clients keep theirs for less (docs/api.md, "Long-lived clients").
        timeout_keep_alive=settings.idle_timeout_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=settings.shutdown_grace,  # type: ignore[arg-type]
    )
