"""Reference decodes, once per host: single flight, then a byte-budgeted cache.

A decode is identified by the file's identity (device, inode, size, mtime) and
its parameters, so a rewritten file is decoded again. Concurrent requests for
one key wait on one ffmpeg run and all get its answer: a duplicate of the same
sealed memfd, or the same error. Failures are not cached. ffmpeg runs on a
thread pool; everything that touches the flights and the cache runs on the
event loop, so handing out a duplicate can never race an eviction.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from framewire.core.decode import Decoded, DecodeRun
from framewire.core.errors import Conflict, MediaError, NotFound, Overloaded, Unavailable
from framewire.core.media.binary import Binary
from framewire.core.media.inputs import InputFile
from framewire.core.wire import DecodeRequest
from framewire.service._access.paths import open_input, real_roots
from framewire.service._access.peers import READ, TRUSTED, Access
from framewire.service._ops.metrics import Metrics
from framewire.service._settings import Settings

# A file that changes during this many decodes in a row is being written: refused.
DECODE_ATTEMPTS = 2


@dataclass(frozen=True)
class DecodeKey:
    dev: int
    ino: int
    size: int
    mtime_ns: int
    fps: float
    width: int
    height: int
    start: float
    max_frames: int | None


@dataclass(frozen=True)
class Answer:
    """One caller's answer. ``fd`` is a duplicate the caller must close."""

    fd: int
    frames: int
    byte_size: int
    decode_ms: float
    cached: bool


def file_identity(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class DecodeCache:
    """Least-recently-used sealed memfds under a byte budget. Owns and closes their fds.

    Closing an evicted fd never affects callers: each got its own duplicate.
    """

    def __init__(self, budget: int, metrics: Metrics):
        self.budget = budget
        self.metrics = metrics
        self._entries: OrderedDict[DecodeKey, Decoded] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: DecodeKey) -> Decoded | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: DecodeKey, entry: Decoded) -> bool:
        """Keep ``entry`` (the cache now owns its fd); False when it can never fit."""
        if entry.byte_size > self.budget or key in self._entries:
            return False
        while self.bytes + entry.byte_size > self.budget:
            self._evict_oldest()
        self._entries[key] = entry
        self.bytes += entry.byte_size
        self._report()
        return True

    def _evict_oldest(self) -> None:
        _, old = self._entries.popitem(last=False)
        self.bytes -= old.byte_size
        os.close(old.fd)

    def clear(self) -> None:
        while self._entries:
            self._evict_oldest()
        self._report()

    def _report(self) -> None:
        self.metrics.decode_cache_bytes.set(self.bytes)
        self.metrics.decode_cache_entries.set(len(self._entries))


@dataclass
class _Flight:
    """A decode in progress and the callers waiting for it."""

    waiters: list[asyncio.Future[Answer]] = field(default_factory=list)


class ReferenceDecoder:
    def __init__(self, settings: Settings, binary: Binary, metrics: Metrics):
        self.settings = settings
        self.binary = binary  # run from its descriptor (core/media/binary.py)
        self.ffmpeg = binary.path  # as /v1/info names it
        self.metrics = metrics
        self.cache = DecodeCache(settings.decode_cache_bytes, metrics)
        self.slots = max(1, settings.cpu_slots)
        self.max_flights = self.slots + settings.max_queue
        self._pool = ThreadPoolExecutor(self.slots, thread_name_prefix="framewire-decode")
        self._flights: dict[DecodeKey, _Flight] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._runs: set[DecodeRun] = set()
        self._runs_lock = threading.Lock()
        self._closed = False

    def _identify(self, raw: str, access: Access) -> tuple[Path, tuple[int, int, int, int]]:
        roots = self.settings.input_roots
        with open_input(raw, roots) as source:
            path = Path(source.name)
            access.check_path(path, real_roots(roots), READ, raw, os.fstat(source.fd))
            return path, source.identity()

    def _check_decoder(self, asked: str) -> None:
        held = self.binary.identity()
        if asked != held:
            self.metrics.encoder_unavailable.labels("decode").inc()
            raise Conflict(
                f"this worker decodes with {held}, not {asked!r} (FRAMEWIRE_DECODE_FFMPEG)",
                code="encoder_unavailable",
            )

    async def decode(self, request: DecodeRequest, access: Access = TRUSTED) -> Answer:
        """The answer to one request: from the cache, a running decode, or a new one.

        ``access``: whose request it is; they must be able to read the video themselves.
        """
        if request.decoder is not None:
            await asyncio.to_thread(self._check_decoder, request.decoder)
        # Path checks and stat touch the filesystem: off the event loop.
        path, ident = await asyncio.to_thread(self._identify, request.path, access)
        key = DecodeKey(
            *ident,
            request.fps,
            request.width,
            request.height,
            request.start,
            request.max_frames,
        )
        entry = self.cache.get(key)
        if entry is not None:
            self.metrics.decode_cache_hits.inc()
            return Answer(os.dup(entry.fd), entry.frames, entry.byte_size, entry.decode_ms, True)
        flight = self._flights.get(key)
        if flight is None:
            if self._closed:
                raise Unavailable("the worker is shutting down")
            if len(self._flights) >= self.max_flights:
                raise Overloaded(f"{len(self._flights)} distinct decodes are already waiting")
            flight = self._flights[key] = _Flight()
            task = asyncio.create_task(self._run(key, path, request, flight))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self.metrics.decode_coalesced.inc()
        waiter: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        flight.waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            # Cancelled after the answer was set: its duplicate is ours to close.
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                os.close(waiter.result().fd)
            raise

    async def _run(
        self, key: DecodeKey, path: Path, request: DecodeRequest, flight: _Flight
    ) -> None:
        loop = asyncio.get_running_loop()
        try:
            decoded, unchanged = await loop.run_in_executor(
                self._pool, self._decode_blocking, path, request, key
            )
        except BaseException as exc:
            del self._flights[key]
            self.metrics.decode_failures.inc()
            error = exc if isinstance(exc, Exception) else Unavailable("decode interrupted")
            for w in flight.waiters:
                if not w.done():
                    w.set_exception(error)
            if not isinstance(exc, Exception):
                raise
            return
        # From here to the end nothing awaits: waiters get their duplicates before
        # the cache (or the close below) can let go of the fd.
        del self._flights[key]
        for w in flight.waiters:
            if not w.done():
                dup = os.dup(decoded.fd)
                w.set_result(
                    Answer(dup, decoded.frames, decoded.byte_size, decoded.decode_ms, False)
                )
        # Frames of a newer version of the file than the key names: answer, don't keep.
        if not (unchanged and not self._closed and self.cache.put(key, decoded)):
            os.close(decoded.fd)

    def _decode_blocking(
        self, path: Path, request: DecodeRequest, key: DecodeKey
    ) -> tuple[Decoded, bool]:
        """Decode ``path``; returns the frames and whether they are of ``key``'s file.

        ffmpeg reads the file opened here, by its fd. Written in place during the
        run, it may give a mix of versions; replaced (renamed over) during the run,
        the frames are of a file no longer at the path. Either way it is decoded
        again (the waiters get the file as it is now, never a mix); changing again
        means the file is being written to.
        """
        asked = (key.dev, key.ino, key.size, key.mtime_ns)
        for _ in range(DECODE_ATTEMPTS):
            with open_input(str(path), self.settings.input_roots) as source:
                before = source.identity()
                decoded = self._run_ffmpeg(source, request)
                after = source.identity()
            try:
                now = file_identity(path)
            except OSError:
                now = None
            if before == after == now:
                return decoded, before == asked
            os.close(decoded.fd)
            if now is None:
                raise NotFound(f"reference video {path} went away while decoding", code="not_found")
        raise MediaError(
            f"reference video {path} changed during each of {DECODE_ATTEMPTS} decodes",
            code="input_changed",
        )

    def _run_ffmpeg(self, source: InputFile, request: DecodeRequest) -> Decoded:
        with self._runs_lock:  # close() kills what is registered here, so start under it
            if self._closed:
                raise Unavailable("the worker is shutting down")
            run = DecodeRun(
                self.binary.exe,
                source,
                request,
                max_bytes=self.settings.max_decode_bytes,
                stall_s=self.settings.stall_timeout_s,
            )
            self.metrics.decodes.inc()
            self._runs.add(run)
        try:
            return run.wait()
        finally:
            with self._runs_lock:
                self._runs.discard(run)

    async def close(self) -> None:
        """Stop running decodes (their waiters fail), wait for the threads, drop the cache."""
        self._closed = True
        with self._runs_lock:
            for run in self._runs:
                run.kill()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pool.shutdown(wait=True, cancel_futures=True)
        with contextlib.suppress(Exception):
            self.cache.clear()
