"""A stream session's first chunk: its CPU (and GPU) slots, held until it ends unless it
is stopped while it waits for them; then its encoder child, and, for an object output,
what sends the object's parts while it is encoded."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from framewire.core.errors import FramewireError
from framewire.service._encode.resources import EncodeResources
from framewire.service._encode.scheduler import Admission
from framewire.service._ops.metrics import Metrics
from framewire.service._sources.frames import FrameSource
from framewire.service._stream.output import StreamOutput
from framewire.service._stream.session import Session

StoreFailed = Callable[[Session, FramewireError], None]


async def start(
    session: Session,
    source: FrameSource,
    admission: Admission,
    resources: EncodeResources,
    metrics: Metrics,
    store_failed: StoreFailed,
    ahead_bytes: int,
) -> None:
    """Admission (held until the session ends), then the child. ``store_failed`` is
    called on the loop when the object's parts can no longer be sent; ``ahead_bytes``:
    the converted frames the output may hold ahead of its encoder."""
    encoder = resources.encoder
    threads = encoder.threads_for(session.geometry.height, session.params)
    gpu = encoder.gpu_bytes(source)
    slots = resources.scheduler.hold(threads, gpu, source.gpu_index, admission=admission)
    await _admitted(session, slots, metrics)
    session.started = time.time()
    loop = asyncio.get_running_loop()

    def failed(exc: FramewireError) -> None:  # on the follower's thread
        loop.call_soon_threadsafe(store_failed, session, exc)

    session.early = resources.uploads.early(session.url, session.cancel, failed)
    session.output = await asyncio.to_thread(
        StreamOutput,
        encoder,
        session.path,
        session.params,
        session.geometry,
        session.directory,
        session.live,
        session.early,
        ahead_bytes,
        session.url is None,  # a spooled output (memory, object) is not fsynced
    )


async def _admitted(
    session: Session, slots: contextlib.AbstractAsyncContextManager[float], metrics: Metrics
) -> None:
    """Wait for the session's slots (held until it ends) unless it is stopped first:
    an abort must not wait for another session to let go of the CPU."""
    session.waiting_since = time.monotonic()
    metrics.queue_waiting.inc()
    entered = asyncio.ensure_future(session.admission.enter_async_context(slots))
    stopped = asyncio.ensure_future(session.stopped.wait())
    try:
        await asyncio.wait((entered, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        session.waiting_since = None
        metrics.queue_waiting.dec()
        stopped.cancel()
        if not entered.done():
            entered.cancel()  # leaves the queue; nothing was taken
        await asyncio.gather(entered, stopped, return_exceptions=True)
    if entered.cancelled():
        session.check()  # stopped: Cancelled, and the session ends as aborted
    entered.result()  # granted (released by the session's end), or its error
    metrics.in_flight.inc()  # a running encode until its slots go, as a job's is
    session.admission.callback(metrics.in_flight.dec)
    session.check()
