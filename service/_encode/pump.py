"""The sendfile pump that feeds ffmpeg's stdin from staging, chunk by chunk.

Chunk k+1 is converted (into the next staging slot, ``staging``) while chunk k
is sent. Conversion walks each chunk in blocks of about ``BLOCK_BYTES`` of source
data (whole frames, or rows of one frame), so the float temporaries stay in
cache and each source byte crosses memory once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from framewire.core.closing import Closing
from framewire.core.media.pipe import (
    READ_POLL_S,
    FfmpegExited,
    PipeWriter,
    pipe_capacity,
    pipe_unread,
    reader_gone,
)
from framewire.core.wire import DType, Layout
from framewire.service._convert import kernels
from framewire.service._convert.convert import convert_into
from framewire.service._convert.kept import KeptStaging
from framewire.service._convert.staging import ChunkWriter, Staging
from framewire.service._sources.frames import FrameSource, Geometry

BLOCK_BYTES = 1 << 20  # source bytes converted at once: fits a core's L2
# The compiled kernel keeps no temporaries, so its blocks need not fit a cache: larger
# ones cut the per-block work in Python (measured: a third less CPU at 4 MiB).
KERNEL_BLOCK_BYTES = 4 << 20

# Told how many frames of the clip ffmpeg has been fed so far, after each piece (for a
# progress display). Runs on the sending thread between sends: it must be quick.
Progress = Callable[[int], None]


def blocks(
    g: Geometry, t0: int, t1: int, size: int = BLOCK_BYTES
) -> Iterator[tuple[int, int, int, int]]:
    """(t0, t1, r0, r1) blocks of about ``size`` source bytes covering frames [t0, t1):
    whole frames, or rows of one frame."""
    row = 3 * g.width * g.dtype.itemsize
    frame = row * g.height
    if frame <= size:
        step = max(1, size // frame)
        for a in range(t0, t1, step):
            yield a, min(a + step, t1), 0, g.height
        return
    rows = max(1, size // row)
    for t in range(t0, t1):
        for r in range(0, g.height, rows):
            yield t, t + 1, r, min(r + rows, g.height)


def chunk_spans(frames: int, per_chunk: int) -> list[tuple[int, int]]:
    return [(t0, min(t0 + per_chunk, frames)) for t0 in range(0, frames, per_chunk)]


def send_in_pieces(
    frames: int,
    per_chunk: int,
    send: Callable[[int, int], None],
    progress: Progress | None = None,
) -> None:
    """``send(t0, t1)`` for each piece of ``per_chunk`` frames in order, ``progress`` told
    after each: frames already in one buffer, fed with a progress count on the way."""
    for t0, t1 in chunk_spans(frames, per_chunk):
        send(t0, t1)
        if progress is not None:
            progress(t1)


class HostWriter(ChunkWriter):
    """The CPU converter: cache-sized blocks of what the source's ``read`` returns.

    ``convert`` (block, layout, out) replaces the standard conversion: an engine
    profile's own (profiles.py).
    """

    def __init__(
        self,
        source: FrameSource,
        convert: Callable[[torch.Tensor, Layout, torch.Tensor], None] | None = None,
    ):
        self.source = source
        self.convert = convert
        self.scratch: torch.Tensor | None = None  # float scaling space, for frames not ours
        self.planes = torch.empty(BLOCK_BYTES, dtype=torch.uint8)  # the cast, pre-interleave

    def write(self, take: Callable[[], torch.Tensor], t0: int, t1: int) -> None:
        g = self.source.geometry
        out = take().view(t1 - t0, g.height, g.width, 3)
        # Frames that are rgb24 already: every profile takes them as they are.
        if self.source.read_into(t0, t1, out):
            del out
            return
        compiled = g.dtype is DType.float32 and kernels.kernels() is not None
        size = KERNEL_BLOCK_BYTES if compiled and self.convert is None else BLOCK_BYTES
        try:
            for a, b, r0, r1 in blocks(g, t0, t1, size):
                block, owned = self.source.read(a, b, r0, r1)
                target = out[a - t0 : b - t0, r0:r1]
                if self.convert is not None:
                    self.convert(block, g.layout, target)
                    continue
                if not owned and block.dtype != torch.uint8 and self.scratch is None:
                    self.scratch = torch.empty(BLOCK_BYTES, dtype=block.dtype)
                convert_into(
                    block, g.layout, target, scratch=self.scratch, planes=self.planes, inplace=owned
                )
        finally:
            del out  # no view of the mapping may outlive the call


class PumpStopped(Exception):
    """The pump gave up (ffmpeg gone, cancelled) while a writer waited for a slot."""


class PipeDrain:
    """Tells a writer when the pipe's reader has consumed all a slot last sent.

    For pinned slots, which cannot be punched. The reader has consumed at least
    ``written - unread`` bytes, where ``written`` counts completed sends only (the
    staging's count, ``Staging.sent``): a send still running adds to ``unread`` alone,
    so the estimate errs low, never high.
    """

    def __init__(self, fd: int, staging: Staging):
        self.fd = fd
        self.staging = staging
        self._cond = threading.Condition()
        self._stopped = False

    def sent(self, slot: int, nbytes: int) -> None:
        """Slot ``slot``'s send completed: counted by the staging, told to the waiters."""
        with self._cond:
            self.staging.sent(slot, nbytes)
            self._cond.notify_all()

    def passed(self, nbytes: int) -> None:
        """``nbytes`` sent from elsewhere than a slot completed: counted by the staging,
        told to the waiters."""
        with self._cond:
            self.staging.passed(nbytes)
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def wait(self, slot: int) -> None:
        with self._cond:
            while not self._stopped:
                end = self.staging.ends[slot]
                if end is not None and self.staging.written - pipe_unread(self.fd) >= end:
                    return
                # Bytes left in a pipe nobody reads never drain, and the sender waits on us.
                if reader_gone(self.fd):
                    raise FfmpegExited("ffmpeg closed its input early")
                self._cond.wait(READ_POLL_S)
        raise PumpStopped("the pump stopped")


class Pump(Closing):
    """Feeds one ffmpeg's stdin with converted frames from a staging memfd of ``slots``
    slots, source after source (one encode's clip, or a stream session's chunks).

    The calling thread converts each piece (``per_chunk`` frames) into the next slot;
    a sending thread sends the slots into the pipe in order, so a piece is converted
    while the one before it is sent (both release the GIL). The slots go round across
    sources, and what the pipe may still hold of each is tracked across them too, so a
    slot is never rewritten under the pipe. ``ahead_bytes``: slots beyond the two, as
    many as fit, so that a source's frames may all be converted before ffmpeg has read
    them (``send(wait=False)``): the producer runs ahead of the encoder by at most that.
    ``kept``: where the staging memfd comes from and goes back to.
    """

    def __init__(
        self,
        pipe: PipeWriter,
        height: int,
        width: int,
        per_chunk: int,
        ahead_bytes: int = 0,
        kept: KeptStaging | None = None,
    ):
        self.pipe = pipe
        self.frame_bytes = 3 * height * width
        self.per_chunk = per_chunk
        self._next_slot = 0
        self._failure: BaseException | None = None
        self._stopping = False
        slot_bytes = per_chunk * self.frame_bytes
        slots = 2 + ahead_bytes // slot_bytes
        self.staging = Staging(slot_bytes, slots, in_flight=pipe_capacity(pipe.fd), kept=kept)
        self.drain = PipeDrain(pipe.fd, self.staging)
        self._sends: list[Future[None] | None] = [None] * slots
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="framewire-send")

    def send(
        self,
        source: FrameSource,
        check: Callable[[], None] = lambda: None,
        writer: ChunkWriter | None = None,
        progress: Progress | None = None,
        *,
        wait: bool = True,
    ) -> int:
        """Convert all of ``source``'s frames and send them; returns the bytes converted.

        When this returns, nothing of ``source`` is read any more: its buffer may be
        reused. ``wait``: also until the pipe took every byte (else they go on being
        sent; :meth:`flush` waits, and a send's failure is raised by the next call).
        ``check`` runs between pieces and while the pipe is full, and may raise to
        stop; after a failure the pump is spent. ``writer`` defaults to the source's
        own converter, else the host one. ``progress`` is told the frames of
        ``source`` sent so far, after each piece.
        """
        self._raise_failure()
        writer = writer or source.chunk_writer() or HostWriter(source)
        converted = 0
        done = False
        try:
            writer.open(self.staging, self.per_chunk)
            for t0, t1 in chunk_spans(source.geometry.frames, self.per_chunk):
                slot = self._claim()
                nbytes = (t1 - t0) * self.frame_bytes

                def take(slot: int = slot, nbytes: int = nbytes) -> torch.Tensor:
                    # Page-locked slots are never punched (the pages a GPU copies into
                    # must stay the mapping's): wait until the pipe let go of the slot
                    # instead. The staging stays locked from a session's first CUDA
                    # chunk to its end, so a host chunk after it waits too.
                    if writer.pinned or self.staging.locked:
                        self.drain.wait(slot)
                        return self.staging.slot(slot, nbytes, punch=False)
                    return self.staging.slot(slot, nbytes)

                writer.write(take, t0, t1)
                check()
                self._sends[slot] = self._sender.submit(
                    self._send_slot, slot, nbytes, check, progress, t1
                )
                converted += nbytes
            done = True
        finally:
            if not done:
                self._fail(PumpStopped("a source was converted in part"))
            writer.close()  # nothing of the source is read after this
        # An encoder already gone is said now, not by the chunk after this one.
        if wait or reader_gone(self.pipe.fd):
            self.flush()
        return converted

    def send_uncopied(self, fd: int, offset: int, nbytes: int, check: Callable[[], None]) -> None:
        """Send ``nbytes`` at ``offset`` of ``fd`` (rgb24 frames in shared memory: nothing to
        convert) into the pipe as they are, after everything converted before them.
        Returns once the reader has consumed them all: a pipe holds references to the
        pages it was sent, not copies, so the producer may write them again only then."""
        self.flush()
        stopped_or = self._unless_stopped(check)
        try:
            self.pipe.send_file(fd, offset, nbytes, stopped_or)
            self.drain.passed(nbytes)
            self.pipe.wait_read(stopped_or)
        except BaseException as exc:
            self._fail(exc)
            raise

    def flush(self) -> None:
        """Until every converted byte is in the pipe; raises a send's failure."""
        for future in self._sends:
            if future is not None:
                future.exception()  # wait; the first failure is raised below
        self._raise_failure()

    def _claim(self) -> int:
        """The next slot, once its last send is over (and raised its failure, if any)."""
        slot = self._next_slot
        previous = self._sends[slot]
        if previous is not None:
            previous.exception()
            self._raise_failure()
        self._next_slot = (slot + 1) % len(self._sends)
        return slot

    def _send_slot(
        self,
        slot: int,
        nbytes: int,
        check: Callable[[], None],
        progress: Progress | None,
        frames: int,
    ) -> None:
        stopped_or = self._unless_stopped(check)
        try:
            stopped_or()
            self.pipe.send_file(self.staging.fd, slot * self.staging.slot_bytes, nbytes, stopped_or)
        except BaseException as exc:
            self._fail(exc)
            raise
        self.drain.sent(slot, nbytes)
        if progress is not None:
            progress(frames)

    def _unless_stopped(self, check: Callable[[], None]) -> Callable[[], None]:
        """``check`` for a send: PumpStopped first, once the pump is closing or failed."""

        def stopped_or() -> None:
            if self._stopping or self._failure is not None:
                raise PumpStopped("the pump stopped")
            check()

        return stopped_or

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self.drain.stop()  # a converter waiting on a pinned slot gives up

    def _raise_failure(self) -> None:
        if self._failure is not None:
            if isinstance(self._failure, PumpStopped):
                raise RuntimeError("the pump failed before: its ffmpeg's input is incomplete")
            raise self._failure

    def close(self) -> None:
        self._stopping = True
        self.drain.stop()
        self._sender.shutdown(wait=True, cancel_futures=True)
        self.staging.close()


def pump_converted(
    source: FrameSource,
    pipe: PipeWriter,
    per_chunk: int,
    *,
    check: Callable[[], None] = lambda: None,
    writer: ChunkWriter | None = None,
) -> int:
    """Convert ``source`` and send it into ``pipe`` with a :class:`Pump` of its own."""
    g = source.geometry
    with Pump(pipe, g.height, g.width, per_chunk) as pump:
        return pump.send(source, check, writer)
