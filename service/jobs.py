"""An encode request, end to end: check everything, open the sources, encode, validate.

Every output is checked (paths, sources, sizes) before any encode starts, so a
bad request writes nothing. Encodes run on worker threads, never on the event
loop; a client that disconnects cancels them (ffmpeg killed, temp removed), and
so does a shutdown whose grace period ran out, which answers 503 for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from framewire.client.errors import BadRequest, Cancelled, Conflict, FramewireError, Unavailable
from framewire.client.inputs import InputFile
from framewire.client.wire import (
    CudaIpcSource,
    EncodeRequest,
    ErrorInfo,
    MediaInfo,
    OutputResult,
    OutputSpec,
    RegionSource,
    ShmSource,
    Source,
    Timings,
)

from .encoder import Encoded, EncodeParams, Encoder
from .ffmpeg import kill_running
from .metrics import Metrics
from .paths import open_input, open_output_dir, real_roots, remove_made, resolve_output
from .peers import READ, SEARCH, TRUSTED, WRITE, Access
from .regions import CudaRegion, RegionRegistry, SystemRegion
from .scheduler import Scheduler
from .settings import Settings
from .sources import FileSource, FrameSource, Geometry, open_shm
from .validate import validate_output

if TYPE_CHECKING:
    from .cuda_source import CudaRuntime

DISCONNECT_POLL_S = 0.1
STOP_WAIT_S = 10.0  # how long a shutdown waits for stopped requests to send their answers
SHUTTING_DOWN = "the worker is shutting down; the encode was stopped"

log = logging.getLogger("framewire.jobs")


@dataclass
class Prepared:
    spec: OutputSpec
    path: Path
    source: FrameSource
    params: EncodeParams
    directory: int = -1  # fd of path's directory, opened without following links
    made: list[Path] = field(default_factory=list)  # directories made for it, outermost first


def _geometry(src: ShmSource | RegionSource) -> Geometry:
    return Geometry(src.dtype, src.layout, src.frames, src.height, src.width)


class OutputClaims:
    """The outputs being written now, by (device, directory inode, name).

    Two writers of one file would each rename theirs into place, and the answer
    of the one renamed first would describe a file that is gone: the second
    asks while the first writes and gets 409 ``output_busy``. Event loop only.
    """

    def __init__(self) -> None:
        self._held: set[tuple[int, int, str]] = set()

    def claim(self, directory: int, name: str, stack: contextlib.AsyncExitStack) -> None:
        st = os.fstat(directory)
        key = (st.st_dev, st.st_ino, name)
        if key in self._held:
            raise Conflict(
                f"another encode is writing {name!r} in that directory now", code="output_busy"
            )
        self._held.add(key)
        stack.callback(self._held.discard, key)


class EncodeJobs:
    def __init__(
        self,
        settings: Settings,
        encoder: Encoder,
        regions: RegionRegistry,
        metrics: Metrics,
        scheduler: Scheduler,
        cuda: CudaRuntime | None = None,
    ):
        self.settings = settings
        self.encoder = encoder
        self.regions = regions
        self.metrics = metrics
        self.scheduler = scheduler
        self.cuda = cuda  # None: no usable GPU, cuda_ipc sources are refused
        self.claims = OutputClaims()
        # Every admitted encode has its thread; the scheduler, not the pool, limits them.
        self.pool = ThreadPoolExecutor(
            max(4, settings.cpu_slots + 2), thread_name_prefix="framewire-encode"
        )
        self.stopping = False
        self._cancels: set[threading.Event] = set()  # one per request in flight
        self._requests: set[asyncio.Task[object]] = set()  # the tasks serving them

    async def _judge(
        self, spec: OutputSpec, access: Access, stack: contextlib.AsyncExitStack
    ) -> Prepared:
        """Everything about one output that can be refused, before anything is made."""
        # Off the event loop: judging paths is the filesystem's time.
        path = await asyncio.to_thread(self._judge_path, spec.path, access)
        audio: InputFile | None = None
        if spec.audio is not None:
            audio = await asyncio.to_thread(self._open_input, spec.audio, access)
            stack.callback(audio.close)
        source = await self._open_source(spec.source, access, stack)
        stack.callback(source.close)
        params = EncodeParams(
            fps=spec.fps,
            quality=spec.quality,
            preset=spec.preset,
            threads=spec.threads,
            audio=audio,
        )
        return Prepared(spec, path, source, params)

    def _judge_path(self, raw: str, access: Access) -> Path:
        roots = self.settings.output_roots
        path = resolve_output(raw, roots)
        # Where the file, or the first directory made for it, lands: the caller must be
        # able to write there. (A root gone missing fails the open later: a 503.)
        parent = _existing(path.parent)
        if any(parent.is_relative_to(root) for root in real_roots(roots)):
            access.check_path(parent, real_roots(roots), WRITE | SEARCH, raw)
        return path

    def _open_input(self, raw: str, access: Access) -> InputFile:
        roots = self.settings.input_roots
        opened = open_input(raw, roots)
        try:
            access.check_path(Path(opened.name), real_roots(roots), READ, raw, os.fstat(opened.fd))
        except BaseException:
            opened.close()
            raise
        return opened

    async def _open_source(
        self, src: Source, access: Access, stack: contextlib.AsyncExitStack
    ) -> FrameSource:
        if isinstance(src, ShmSource):
            # Off the event loop: opening and checking a file is the filesystem's time.
            return await asyncio.to_thread(self._open_shm, src, access)
        if isinstance(src, RegionSource):
            region = await stack.enter_async_context(
                self.regions.lease(src.region, src.offset, src.byte_size, access)
            )
            if isinstance(region, SystemRegion):
                offset = region.offset + src.offset
                return FileSource(region.fd, offset, _geometry(src), owns_fd=False)
            assert isinstance(region, CudaRegion) and self.cuda is not None
            return self.cuda.region_source(region, src)
        assert isinstance(src, CudaIpcSource)
        if self.cuda is None:
            raise BadRequest(
                "this worker has no CUDA device; send host memory instead",
                code="cuda_unavailable",
            )
        # Opening a handle is driver work (milliseconds): off the event loop.
        return await asyncio.to_thread(self.cuda.open_ipc, src)

    def _open_shm(self, src: ShmSource, access: Access) -> FileSource:
        fd = open_shm(src.key, self.settings.shm_prefixes)
        try:
            access.check(os.fstat(fd), READ, f"shm segment {src.key!r}")
            return FileSource(fd, src.offset, _geometry(src))
        except BaseException:
            os.close(fd)
            raise

    async def _place(self, job: Prepared, stack: contextlib.AsyncExitStack) -> None:
        """Make and open the output's directory and claim its name (all judged before)."""
        roots = self.settings.output_roots
        job.directory = await asyncio.to_thread(open_output_dir, job.path, roots, job.made)
        stack.callback(os.close, job.directory)
        self.claims.claim(job.directory, job.path.name, stack)

    def _encode_one(self, job: Prepared, validate: bool, cancel: threading.Event) -> OutputResult:
        started = time.time()
        g = job.source.geometry
        validate_ms = 0.0
        info: MediaInfo | None = None

        def check_file(staged: str) -> None:
            # Before the rename: a file that fails validation never appears.
            nonlocal validate_ms, info
            t0 = time.perf_counter()
            try:
                info = validate_output(
                    Path(staged),
                    frames=g.frames,
                    width=g.width,
                    height=g.height,
                    fps=job.params.fps,
                    audio=job.params.audio is not None,
                )
            finally:
                validate_ms = (time.perf_counter() - t0) * 1e3

        encoded: Encoded = self.encoder.encode(
            job.source,
            job.path,
            job.params,
            cancel=cancel,
            directory=job.directory,
            inspect=check_file if validate else None,
        )
        if encoded.fast_path_error is not None:
            log.warning(
                "output %s was redone on the reference route",
                job.path,
                extra={"fast_path_error": encoded.fast_path_error},
            )
        self.metrics.encode_seconds.labels(encoded.route).observe(encoded.encode_ms / 1e3)
        self.metrics.bytes_written.inc(encoded.bytes)
        if encoded.route == "fallback":
            self.metrics.fallbacks.inc()
        return OutputResult(
            path=str(job.path),
            ok=True,
            bytes=encoded.bytes,
            sha256=encoded.sha256,
            frames=encoded.frames,
            width=info.width if info else None,
            height=info.height if info else None,
            fps=job.params.fps,
            duration=info.duration if info else None,
            audio=info.audio if info else None,
            route=encoded.route,
            timings=Timings(
                encode_ms=encoded.encode_ms,
                validate_ms=validate_ms,
                started_at=started,
                finished_at=time.time(),
            ),
        )

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
        if self.stopping:
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
            self._requests.discard(me)  # type: ignore[arg-type]

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
                jobs = [await self._judge(spec, access, stack) for spec in request.outputs]
                if len({j.path for j in jobs}) != len(jobs):
                    raise BadRequest("two outputs resolve to the same file", code="duplicate_path")
                self.scheduler.admit(len(jobs))
                for job in jobs:
                    await self._place(job, stack)
                _, outcomes = await self._encode_all(request, jobs, is_disconnected, cancel, me)
        except BaseException:
            for job in jobs:
                remove_made(job.made)
            raise
        for job, (_, result) in zip(jobs, outcomes, strict=True):
            if not result.ok:
                remove_made(job.made)
        status = next((s for s, _ in outcomes if s != 200), 200)
        return status, [r for _, r in outcomes]

    async def _encode_all(
        self,
        request: EncodeRequest,
        jobs: list[Prepared],
        is_disconnected: Callable[[], Awaitable[bool]],
        cancel: threading.Event,
        me: asyncio.Task[object] | None,
    ) -> tuple[bool, list[tuple[int, OutputResult]]]:
        """Run every output; returns (stopped by a shutdown, one outcome per output)."""
        tasks: list[asyncio.Task[tuple[int, OutputResult]]] = []
        watcher: asyncio.Task[None] | None = None
        try:
            tasks = [
                asyncio.create_task(self._run_one(job, request.validate_, cancel)) for job in jobs
            ]
            watcher = asyncio.create_task(self._watch(is_disconnected, cancel, tasks))
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
        self, job: Prepared, validate: bool, cancel: threading.Event
    ) -> tuple[int, OutputResult]:
        threads = self.encoder.threads_for(job.source.geometry.height, job.params)
        gpu = self.encoder.gpu_bytes(job.source)  # conversion temporaries on its GPU
        self.metrics.queue_waiting.inc()
        queued = True
        try:
            async with self.scheduler.hold(threads, gpu, job.source.gpu_index) as waited:
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
                    fields = {"code": exc.code} | ({"detail": exc.detail} if exc.detail else {})
                    log.warning("output %s failed: %s", job.path, exc.message, extra=fields)
                    result = OutputResult(
                        path=str(job.path),
                        ok=False,
                        error=ErrorInfo(code=exc.code, message=exc.message, detail=exc.detail),
                        timings=Timings(queue_ms=waited * 1e3),
                    )
                    status = exc.status
                finally:
                    self.metrics.in_flight.dec()
        finally:
            if queued:
                self.metrics.queue_waiting.dec()
        self.metrics.outputs.labels("ok" if result.ok else "error").inc()
        return status, result

    async def _in_thread(
        self, cancel: threading.Event, job: Prepared, validate: bool
    ) -> OutputResult:
        """Run one encode on the pool. If this task is cancelled, the encode is told to stop
        and awaited: its source must stay open until the thread lets go of it. An encode
        that completed anyway is a complete output, and is reported as one."""
        if self.stopping:
            raise Unavailable("the worker is shutting down", code="shutting_down")
        # The thread sees this task's context (the request id its log lines carry).
        context = contextvars.copy_context()
        future = asyncio.get_running_loop().run_in_executor(
            self.pool, context.run, self._encode_one, job, validate, cancel
        )
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            cancel.set()
            await asyncio.wait([future])
            if future.cancelled() or future.exception() is not None:
                raise
            return future.result()

    async def _watch(
        self,
        is_disconnected: Callable[[], Awaitable[bool]],
        cancel: threading.Event,
        tasks: list[asyncio.Task[tuple[int, OutputResult]]],
    ) -> None:
        while not cancel.is_set():
            if await is_disconnected():
                cancel.set()  # running encodes stop at their next chunk
                for task in tasks:
                    task.cancel()  # waiting ones leave the queue
                return
            await asyncio.sleep(DISCONNECT_POLL_S)

    async def stop(self, wait: float = STOP_WAIT_S) -> None:
        """Stop every encode still running or waiting: the grace period is over.

        Their ffmpeg is killed (an encode in ffmpeg's final flush checks nothing), their
        temp files go with their threads, and their requests get to send a 503 before
        the pool is shut down.
        """
        self.stopping = True
        for cancel in list(self._cancels):
            cancel.set()
        killed = kill_running()
        if killed:
            log.warning("shutdown: killed %d ffmpeg process(es) still encoding", killed)
        current = asyncio.current_task()
        pending = {t for t in self._requests if t is not current and not t.done()}
        if pending:
            await asyncio.wait(pending, timeout=wait)
        await asyncio.to_thread(self.pool.shutdown, wait=True, cancel_futures=True)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _existing(directory: Path) -> Path:
    """``directory``, or its nearest ancestor that exists (where new ones would be made)."""
    while not directory.exists() and directory.parent != directory:
        directory = directory.parent
    return directory


def _after_stop(
    job: Prepared, task: asyncio.Task[tuple[int, OutputResult]]
) -> tuple[int, OutputResult]:
    """An output's outcome once a shutdown stopped its request: done, or stopped."""
    if task.done() and not task.cancelled() and task.exception() is None:
        return task.result()
    log.warning("output %s stopped: the worker is shutting down", job.path)
    error = ErrorInfo(code="shutting_down", message=SHUTTING_DOWN)
    return Unavailable.status, OutputResult(path=str(job.path), ok=False, error=error)
