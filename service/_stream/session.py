"""One stream session's state: what it was opened with, how far it got, how it stops."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from framewire.core.errors import Cancelled, Conflict, FramewireError
from framewire.core.wire import StreamOpen, StreamStateName
from framewire.service._encode.params import EncodeParams
from framewire.service._sources.frames import Geometry
from framewire.service._store.uploads import Early, Target
from framewire.service._stream.live import LiveFeed
from framewire.service._stream.output import StreamOutput


def not_open(session_id: str, state: str) -> Conflict:
    return Conflict(f"stream {session_id} is {state}", code="stream_closed")


def ended_by(exc: BaseException) -> tuple[str, FramewireError]:
    """The cause (``client``: cancelled; ``error``) and the error a session that ``exc``
    ended is left with: a fault of no known kind is an ``internal`` one."""
    cause = "client" if isinstance(exc, Cancelled | asyncio.CancelledError) else "error"
    if isinstance(exc, FramewireError):
        return cause, exc
    if isinstance(exc, asyncio.CancelledError):
        return cause, Cancelled("the request was cancelled")
    return cause, FramewireError(f"internal error: {type(exc).__name__}")


@dataclass(eq=False)
class Session:
    id: str
    spec: StreamOpen
    path: Path
    params: EncodeParams
    geometry: Geometry  # frames: 0 (the chunks say how many)
    directory: int
    made: list[Path]
    stack: contextlib.AsyncExitStack  # the claim, the directory, the audio
    url: Target | None = None  # an object or memory output: ``path`` is its spool file
    admission: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    state: StreamStateName = "open"
    received: int = 0
    error: FramewireError | None = None
    output: StreamOutput | None = None
    started: float = field(default_factory=time.time)
    active_at: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    cancel: threading.Event = field(default_factory=threading.Event)
    stopped: asyncio.Event = field(default_factory=asyncio.Event)  # cancel, for the loop
    aborted_by: str | None = None  # why it is being aborted, while a request still runs
    waiting_since: float | None = None  # monotonic, while its first chunk waits for slots
    live: LiveFeed | None = None  # its live view, when it asked for one
    early: Early | None = None  # an object's parts sent, a memory output's copy made

    def stop(self, cause: str) -> None:
        """Abort from outside the request in progress: it stops at its next step, or
        leaves the admission queue at once."""
        self.aborted_by = self.aborted_by or cause
        self.cancel.set()
        self.stopped.set()

    @property
    def shown(self) -> str:  # the output as its caller named it
        return str(self.url or self.path)

    def touch(self) -> None:
        self.active_at = time.monotonic()

    def idle_s(self) -> float:
        return time.monotonic() - self.active_at

    def stale(self, idle: float) -> bool:
        """No request for ``idle`` seconds, or its first chunk has waited that long for
        admission: the worker has read nothing of it meanwhile either way."""
        if self.waiting_since is not None:
            return time.monotonic() - self.waiting_since > idle
        return not self.lock.locked() and self.idle_s() > idle

    def check(self) -> None:
        """Between pieces of blocking work: stop if the session is being aborted, or its
        object's parts can no longer be sent."""
        if self.cancel.is_set():
            raise Cancelled(f"stream {self.id} was aborted")
        if self.early is not None:
            self.early.check()
