"""An encode request, end to end: check everything, open the sources, encode, validate.

Every output is checked (paths, sources, sizes) before any encode starts, so a
bad request writes nothing. Encodes run on worker threads, never on the event
loop; a client that disconnects cancels them (ffmpeg killed, temp removed), and
so does a shutdown whose grace period ran out, which answers 503 for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable

from framewire.core.errors import BadRequest, Cancelled, FramewireError, Unavailable
from framewire.core.media.priority import FULL
from framewire.core.media.process import kill_running
from framewire.core.wire import EncodeRequest, ErrorInfo, OutputResult
from framewire.service._access.paths import keep_made, remove_made
from framewire.service._access.peers import TRUSTED, Access
from framewire.service._encode.prepare import Prepared
from framewire.service._encode.resources import EncodeResources
from framewire.service._encode.results import check_for, failed, written
from framewire.service._encode.scheduler import Admission
from framewire.service._ops.disconnect import watch_caller
from framewire.service._ops.metrics import Metrics
from framewire.service._settings import Settings
from framewire.service._sources.audio import MemoryAudio

# Audio a small output may carry: its AAC encode costs about what a small encode's
# frames do (minutes of audio take seconds).
SMALL_AUDIO_S = 1.0
STOP_WAIT_S = 10.0  # how long a shutdown waits for stopped requests to send their answers
SHUTTING_DOWN = "the worker is shutting down; the encode was stopped"

log = logging.getLogger("framewire.jobs")


class EncodeJobs:
    def __init__(self, settings: Settings, resources: EncodeResources, metrics: Metrics):
        self.settings = settings
        self.resources = resources
        self.metrics = metrics
        self.draining = False  # a shutdown began: no new encodes
        self._cancels: set[threading.Event] = set()  # one per request in flight
        self._requests: set[asyncio.Task[object]] = set()  # the tasks serving them

    def _encode_one(self, job: Prepared, validate: bool, cancel: threading.Event) -> OutputResult:
        started = time.time()
        g = job.source.geometry
        check = check_for(g.frames, g, job.params, validate)
        encoded = self.resources.encoder.encode(
            job.source,
            job.path,
            job.params,
            cancel=cancel,
            directory=job.directory,
            inspect=check,
            follower=job.early,
            durable=job.url is None,  # a spooled output is read back, never kept
        )
        return written(encoded, job.params.fps, check, started, self.metrics)

    async def run(
        self,
        request: EncodeRequest,
        is_disconnected: Callable[[], Awaitable[bool]],
        access: Access = TRUSTED,
    ) -> tuple[int, list[OutputResult]]:
        """Returns (HTTP status, one result per output in request order).

        The outputs run concurrently as far as the scheduler admits them; a
        client that goes away cancels the waiting ones and stops the running ones.
        """
        paths = [o.path for o in request.outputs]
        if len(set(paths)) != len(paths):
            raise BadRequest("two outputs of one request name the same path", code="duplicate_path")
        if self.resources.stopping or self.draining:
            raise Unavailable("the worker is shutting down", code="shutting_down")
        cancel = threading.Event()
        me = asyncio.current_task()
        self._cancels.add(cancel)
        if me is not None:
            self._requests.add(me)
        try:
            return await self._run(request, is_disconnected, cancel, me, access)
        finally:
            self._cancels.discard(cancel)
            if me is not None:
                self._requests.discard(me)

    async def _run(
        self,
        request: EncodeRequest,
        is_disconnected: Callable[[], Awaitable[bool]],
        cancel: threading.Event,
        me: asyncio.Task[object] | None,
        access: Access,
    ) -> tuple[int, list[OutputResult]]:
        jobs: list[Prepared] = []
        outcomes: list[tuple[int, OutputResult]] = []
        try:
            async with contextlib.AsyncExitStack() as stack:
                # Every output is judged before any directory is made: a refused
                # request leaves nothing behind.
                prepare = self.resources.prepare
                jobs = [await prepare.judge(spec, access, stack) for spec in request.outputs]
                if len({j.path for j in jobs}) != len(jobs):
                    raise BadRequest("two outputs resolve to the same file", code="duplicate_path")
                small = sum(self._small(job) for job in jobs)
                # Counted as waiting from here on, its directories' wait included.
                admission = self.resources.scheduler.admit(
                    len(jobs) - small, small, access.share_key
                )
                stack.callback(admission.close)
                for job in jobs:
                    await prepare.place(job, access, stack)
                _, outcomes = await self._encode_all(
                    request, jobs, is_disconnected, cancel, me, admission
                )
        except BaseException:
            for job in jobs:
                remove_made(job.made)
            raise
        for job, (_, result) in zip(jobs, outcomes, strict=True):
            (keep_made if result.ok else remove_made)(job.made)
        status = next((s for s, _ in outcomes if s != 200), 200)
        return status, [r for _, r in outcomes]

    async def _encode_all(
        self,
        request: EncodeRequest,
        jobs: list[Prepared],
        is_disconnected: Callable[[], Awaitable[bool]],
        cancel: threading.Event,
        me: asyncio.Task[object] | None,
        admission: Admission,
    ) -> tuple[bool, list[tuple[int, OutputResult]]]:
        """Run every output; returns (stopped by a shutdown, one outcome per output)."""
        tasks: list[asyncio.Task[tuple[int, OutputResult]]] = []
        watcher: asyncio.Task[None] | None = None
        try:
            tasks = [
                asyncio.create_task(self._run_one(job, request.validate_, cancel, admission))
                for job in jobs
            ]
            watcher = asyncio.create_task(
                watch_caller(is_disconnected, cancel, functools.partial(_stop_all, cancel, tasks))
            )
            return False, list(await asyncio.gather(*tasks))
        except asyncio.CancelledError:
            # Only the server cancels the request's own task: its grace period ran out.
            # A client that went away cancels the outputs' tasks, never this one.
            if me is None or not me.cancelling():
                raise
            me.uncancel()
        finally:
            # Whatever happened, no encode thread may outlive the sources it reads:
            # the caller's exit stack closes them next.
            if watcher is not None:
                watcher.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return True, [_after_stop(job, task) for job, task in zip(jobs, tasks, strict=True)]

    async def _run_one(
        self, job: Prepared, validate: bool, cancel: threading.Event, admission: Admission
    ) -> tuple[int, OutputResult]:
        # An object's parts go to the store while it is encoded, all but what is left
        # when the encode ends.
        job.early = self.resources.uploads.early(job.url, cancel)
        try:
            status, result = await self._encode_held(job, validate, cancel, admission)
            if job.url is not None and result.ok:
                # The CPU slots are free again: the rest waits on the network.
                try:
                    presign_s = job.spec.presign_s
                    result = await self.resources.uploads.deliver(
                        result, job.directory, job.path.name, job.url, presign_s, cancel, job.early
                    )
                except Cancelled:
                    raise
                except FramewireError as exc:
                    status, result = exc.status, failed(job.shown, exc, result.timings.queue_ms)
        finally:
            if job.early is not None:  # nothing of an upload not completed remains
                await asyncio.to_thread(job.early.close)
        self.metrics.outputs.labels("ok" if result.ok else "error").inc()
        return status, result

    def _small(self, job: Prepared) -> bool:
        """Whether the output's whole work is small enough for the small lane: its rgb24
        frames' bytes, and nothing that costs more than they do. The lane runs beside
        full slots, so what it takes there is bounded by what it admits."""
        g = job.source.geometry
        if g.frames * g.height * g.width * 3 > self.settings.small_encode_bytes:
            return False
        if job.params.profile == "vllm-omni":
            return False  # a PyAV child of its own, started per output
        audio = job.params.audio
        if audio is None:
            return True
        # Audio is encoded whole, however few the frames; a file's length is unknown here.
        if not isinstance(audio, MemoryAudio):
            return False
        return audio.source.samples <= SMALL_AUDIO_S * audio.source.sample_rate

    async def _encode_held(
        self, job: Prepared, validate: bool, cancel: threading.Event, admission: Admission
    ) -> tuple[int, OutputResult]:
        """The output encoded while it holds its CPU slots (and GPU bytes)."""
        encoder = self.resources.encoder
        threads = encoder.threads_for(job.source.geometry.height, job.params)
        gpu = encoder.gpu_bytes(job.source)  # conversion temporaries on its GPU
        self.metrics.queue_waiting.inc()
        queued = True
        try:
            small = self._small(job)
            if small:  # a few ms of x264: it goes first, as the event loop does
                job.params = dataclasses.replace(job.params, priority=FULL)
            async with self.resources.scheduler.hold(
                threads, gpu, job.source.gpu_index, small=small, admission=admission
            ) as waited:
                self.metrics.queue_waiting.dec()
                queued = False
                self.metrics.queue_seconds.observe(waited)
                self.metrics.in_flight.inc()
                try:
                    result = await self._in_thread(cancel, job, validate)
                    result.timings.queue_ms = waited * 1e3
                    status = 200
                except Cancelled:
                    raise
                except FramewireError as exc:
                    # ffmpeg's stderr tail goes into the log line, with the request's id.
                    result = failed(job.shown, exc, waited * 1e3)
                    status = exc.status
                finally:
                    self.metrics.in_flight.dec()
        finally:
            if queued:
                self.metrics.queue_waiting.dec()
        return status, result

    async def _in_thread(
        self, cancel: threading.Event, job: Prepared, validate: bool
    ) -> OutputResult:
        return await self.resources.in_pool(cancel, self._encode_one, job, validate, cancel)

    async def stop(self, wait: float = STOP_WAIT_S) -> None:
        """Stop every encode still running or waiting: the grace period is over.

        Their ffmpeg is killed (an encode in ffmpeg's final flush checks nothing), their
        temp files go with their threads, and their requests get to send a 503 before
        the pool is shut down.
        """
        self.resources.stopping = True
        for cancel in list(self._cancels):
            cancel.set()
        killed = kill_running()
        if killed:
            log.warning("shutdown: killed %d ffmpeg process(es) still encoding", killed)
        current = asyncio.current_task()
        pending = {t for t in self._requests if t is not current and not t.done()}
        if pending:
            await asyncio.wait(pending, timeout=wait)
        await self.resources.aclose()


def _stop_all(cancel: threading.Event, tasks: list[asyncio.Task[tuple[int, OutputResult]]]) -> None:
    """The caller went away: running encodes stop at their next chunk, waiting ones leave
    the queue."""
    cancel.set()
    for task in tasks:
        task.cancel()


def _after_stop(
    job: Prepared, task: asyncio.Task[tuple[int, OutputResult]]
) -> tuple[int, OutputResult]:
    """An output's outcome once a shutdown stopped its request: done, or stopped."""
    if task.done() and not task.cancelled() and task.exception() is None:
        return task.result()
    log.warning("output %s stopped: the worker is shutting down", job.shown)
    error = ErrorInfo(code="shutting_down", message=SHUTTING_DOWN)
    return Unavailable.status, OutputResult(path=job.shown, ok=False, error=error)
