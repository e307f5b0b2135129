"""The worker: its sockets, its parts and its lifetime, from start to a clean stop.

``Worker.run`` is what ``framewire serve`` does: bind every socket (or refuse to
start, touching nothing, when another worker holds them), build the parts (the
GPUs are warmed here), serve HTTP with uvicorn and the fd socket beside it
until SIGTERM/SIGINT, drain, stop what still runs past the grace period, and
release everything. ``start``, ``drain`` and ``stop`` are its three steps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from framewire.core.shm import remove_abandoned_segments
from framewire.service._access.paths import make_missing_roots
from framewire.service._http.app import create_app
from framewire.service._http.server import Server, StopSignals, uvicorn_config
from framewire.service._ops.limits import cpu_quota_note, exposure_note, raise_open_files_limit
from framewire.service._ops.logs import configure_logging
from framewire.service._outputs import remove_released, remove_stale_temps
from framewire.service._parts import Parts
from framewire.service._probe import PYAV_MISSING, pyav
from framewire.service._settings import Settings
from framewire.service._sockets import Listeners, UnixListener
from framewire.service._store import spool
from uvicorn.config import LOG_LEVELS

log = logging.getLogger("framewire.worker")

# How long a private directory a killed worker left is watched for the child that still
# holds it (an ffmpeg flushing what it had on its closed stdin) to exit.
HELD_WATCH_S, HELD_POLL_S = 60.0, 0.1
REMOVED = "removed %s, left by a worker that was killed"  # by the start's sweep or the watch
UNMADE = (
    "cannot make %s (%s), a default root (FRAMEWIRE_OUTPUT_ROOTS, FRAMEWIRE_INPUT_ROOTS): "
    "nothing under it is served until it exists; memory:// outputs need no root"
)


class Worker:
    """One framewire worker. ``Worker(settings).run()`` serves until a signal."""

    def __init__(self, settings: Settings | None = None):
        self.settings = settings or Settings()
        self.parts: Parts | None = None
        self.app: FastAPI | None = None
        self._fd_listener: UnixListener | None = None

    def build(self, fd_listener: UnixListener | None = None) -> FastAPI:
        """Build the parts and the app serving them; the fd socket will serve on
        ``fd_listener`` (else on a socket bound at start)."""
        self.parts = Parts.build(self.settings)
        self._fd_listener = fd_listener
        self.app = create_app(self.parts, lifespan=self._lifespan)
        return self.app

    def _built(self) -> Parts:
        if self.parts is None:
            raise RuntimeError("Worker.build() first")
        return self.parts

    @asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    async def start(self) -> None:
        """Sweep what killed workers and clients left, warn about the host, open the fd socket."""
        parts, settings = self._built(), self.settings
        defaults = [
            root
            for name in ("output_roots", "input_roots")
            if name not in settings.model_fields_set
            for root in getattr(settings, name)
        ]
        made, unmade = make_missing_roots(defaults)
        for root in made:
            log.info(
                "made %s (a default root: FRAMEWIRE_OUTPUT_ROOTS, FRAMEWIRE_INPUT_ROOTS)", root
            )
        for root, why in unmade.items():
            log.warning(UNMADE, root, why)  # served anyway: a missing root is a 503
        log.info(
            "outputs go under %s; inputs are read from under %s",
            ", ".join(settings.output_roots),
            ", ".join(settings.input_roots),
        )
        held: list[Path] = []
        swept = remove_stale_temps(settings.output_roots, held=held)
        for path in swept + spool.sweep(settings.output_roots):
            log.warning(REMOVED, path)
        if held:  # removed once the killed worker's children let go of them
            threading.Thread(
                target=_remove_when_released, args=(held,), name="framewire-sweep", daemon=True
            ).start()
        if settings.output_urls:
            # boto3's import and client (half a second) are paid here, not by the first upload.
            threading.Thread(
                target=parts.resources.uploads.warm, name="framewire-s3", daemon=True
            ).start()
        for key in remove_abandoned_segments():
            log.warning("removed shm segment %s, left by a client that was killed", key)
        exposure = exposure_note(settings.host, settings.port, settings.token)
        pyav_note = PYAV_MISSING if pyav() is None else None
        for note in (cpu_quota_note(settings.cpu_slots), exposure, pyav_note):
            if note:
                log.warning(note)
        await parts.fd_server.start(self._fd_listener)

    async def drain(self) -> None:
        """A shutdown began: the fd socket stops accepting, new encodes and sessions are
        refused (503 ``shutting_down``), and open stream sessions get the grace period to
        finish (their producers may still send chunks). HTTP requests in flight are
        uvicorn's to drain, in what is left of the grace."""
        parts = self._built()
        await parts.fd_server.stop_accepting()
        parts.jobs.draining = True
        await parts.sessions.drain(self.settings.shutdown_grace)

    async def stop(self) -> None:
        """Stop everything still running (the grace period is over) and release it all."""
        parts = self._built()
        try:
            # The server has drained what finished within the grace period; the rest
            # is stopped before the fd server and the regions those requests use.
            await parts.sessions.stop()
            await parts.jobs.stop()
            await parts.fd_server.close()
        finally:
            parts.regions.close()
            parts.resources.close()

    def run(self) -> None:
        """Bind, build, serve until SIGTERM/SIGINT, stop. Raises ``AlreadyServed`` (another
        worker holds the sockets), ``NotOwnDirectory`` (a socket's directory is not the
        worker's own) or ``OSError`` (a socket cannot be bound) before anything else is
        touched."""
        configure_logging(self.settings.log_format, LOG_LEVELS[self.settings.log_level.lower()])
        raise_open_files_limit()
        with StopSignals() as stop, Listeners(self.settings) as listeners:
            app = self.build(listeners.fd)
            app.state.tcp_address = listeners.tcp.getsockname()[:2]  # the port, when it was 0
            server = Server(uvicorn_config(app, self.settings), on_drain=self.drain)
            stop.watch(server)
            server.run(sockets=listeners.http)


def _remove_when_released(held: list[Path]) -> None:
    """Removes each of ``held`` once nobody holds it, for ``HELD_WATCH_S`` at most."""
    deadline = time.monotonic() + HELD_WATCH_S
    while True:
        removed, held = remove_released(held)
        for path in removed:
            log.warning(REMOVED, path)
        if not held:
            return
        if time.monotonic() > deadline:
            for path in held:
                log.warning(
                    "%s is still held, by a child of a killed worker or by a worker "
                    "whose pid this one cannot see: left to its holder, or to the next "
                    "start",
                    path,
                )
            return
        time.sleep(HELD_POLL_S)
