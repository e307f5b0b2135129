"""What every encode runs on, a one-shot request's outputs and a stream session's alike:
the encoder, the scheduler's slots, the judge of outputs, the uploads, and the threads."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from framewire.core.errors import Unavailable
from framewire.service._encode.encoder import Encoder
from framewire.service._encode.prepare import Preparer
from framewire.service._encode.scheduler import Scheduler
from framewire.service._ops.threads import in_thread
from framewire.service._store.uploads import Uploads

T = TypeVar("T")


@dataclass(eq=False)
class EncodeResources:
    encoder: Encoder
    scheduler: Scheduler
    uploads: Uploads
    prepare: Preparer
    # The grace period is over: nothing new runs.
    stopping: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        # Every admitted encode has its thread; the scheduler, not the pool, limits them.
        self.pool = ThreadPoolExecutor(
            max(4, self.scheduler.cpu_slots + 2), thread_name_prefix="framewire-encode"
        )

    async def in_pool(self, cancel: threading.Event, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` on the encode pool. If this task is cancelled, ``cancel`` is set
        and the call awaited: what it reads must stay open until the thread lets go of
        it. A call that completed anyway is reported as done."""
        if self.stopping:
            raise Unavailable("the worker is shutting down", code="shutting_down")
        return await in_thread(self.pool, cancel, fn, *args)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.uploads.close()
        self.encoder.close()
