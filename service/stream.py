"""Staging memfds and the sendfile pump that feeds ffmpeg's stdin.

Each encode owns its staging memfd (never shared between jobs). ``sendfile``
into a pipe does not copy: the pipe keeps references to the memfd's pages until
ffmpeg reads them. Rewriting such a page would change bytes ffmpeg has not read
yet. A pipe references at most its capacity in pages, always the most recently
sent ones, so before a slot is rewritten the tail of what it last sent (pipe
capacity plus a page) is punched out (``MADV_REMOVE``): the pipe keeps the old
pages, the next write gets fresh ones. Punching whole slots would cost a page
fault and a zero-fill per page of every chunk.

Conversion walks each chunk in blocks of about ``BLOCK_BYTES`` of source data
(whole frames, or rows of one frame), so the float temporaries stay in cache
and each source byte crosses memory once.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import select
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from framewire.client.errors import BadRequest

from .convert import convert_into
from .ffmpeg import FfmpegExited
from .sources import FrameSource, Geometry

PIPE_BYTES = 1 << 20  # fewer wakeups per chunk than the 64 KiB default
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)
BLOCK_BYTES = 1 << 20  # source bytes converted at once: fits a core's L2
SLOT_TARGET = 8 << 20  # staging bytes per chunk: small enough to start ffmpeg early


def widen_pipe(fd: int) -> None:
    try:
        fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:
        pass  # capped by /proc/sys/fs/pipe-max-size: the default still works


def pipe_capacity(fd: int) -> int | None:
    """Bytes a pipe can hold; None if ``fd`` is not a pipe (then assume the worst)."""
    try:
        return fcntl.fcntl(fd, F_GETPIPE_SZ)
    except OSError:
        return None


SEND_SLICE = 16 << 20  # bytes per sendfile call: how often ``check`` gets a say


def send_all(
    out_fd: int, in_fd: int, offset: int, count: int, check: Callable[[], None] = lambda: None
) -> None:
    """sendfile ``count`` bytes, riding out partial writes, EINTR and EAGAIN.

    EPIPE means ffmpeg is gone; a zero return means the source file got shorter.
    ``check`` runs between slices and may raise to stop.
    """
    while count > 0:
        check()
        try:
            n = os.sendfile(out_fd, in_fd, offset, min(count, SEND_SLICE))
        except BlockingIOError:
            select.select([], [out_fd], [])
            continue
        except BrokenPipeError as exc:
            raise FfmpegExited("ffmpeg closed its input early") from exc
        if n == 0:
            raise BadRequest(
                "the source file shrank while it was being sent", code="segment_truncated"
            )
        offset += n
        count -= n


class Staging:
    """A private memfd with ``slots`` equal slots, mapped and seen as uint8 tensors.

    ``in_flight``: how many bytes sent from it the reader may still hold by
    reference (the pipe's capacity); None means any of them.
    """

    def __init__(self, slot_bytes: int, slots: int = 2, *, in_flight: int | None = None):
        # Page-aligned slots: MADV_REMOVE works on whole pages.
        self.slot_bytes = -(-slot_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.in_flight = in_flight
        self._sent = [0] * slots
        self.fd = os.memfd_create("framewire-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.slot_bytes * slots)
            self._map = mmap.mmap(self.fd, self.slot_bytes * slots)
        except BaseException:
            os.close(self.fd)
            raise

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        """Slot ``index`` as a writable uint8 tensor of ``nbytes``, safe to overwrite."""
        start = index * self.slot_bytes
        sent = self._sent[index]
        if sent:
            tail = sent if self.in_flight is None else min(sent, self.in_flight + mmap.PAGESIZE)
            lo = (start + sent - tail) // mmap.PAGESIZE * mmap.PAGESIZE
            hi = -(-(start + sent) // mmap.PAGESIZE) * mmap.PAGESIZE
            self._map.madvise(mmap.MADV_REMOVE, lo, hi - lo)
        self._sent[index] = nbytes
        return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=start)

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            self._map.close()
        except BufferError:
            pass  # a traceback still holds a slot view; the mapping goes with it
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def slot_frames(height: int, width: int) -> int:
    return max(1, SLOT_TARGET // (3 * height * width))


def blocks(g: Geometry, t0: int, t1: int) -> Iterator[tuple[int, int, int, int]]:
    """(t0, t1, r0, r1) blocks covering frames [t0, t1): whole frames, or rows of one frame."""
    row = 3 * g.width * g.dtype.itemsize
    frame = row * g.height
    if frame <= BLOCK_BYTES:
        step = max(1, BLOCK_BYTES // frame)
        for a in range(t0, t1, step):
            yield a, min(a + step, t1), 0, g.height
        return
    rows = max(1, BLOCK_BYTES // row)
    for t in range(t0, t1):
        for r in range(0, g.height, rows):
            yield t, t + 1, r, min(r + rows, g.height)


def chunk_spans(frames: int, per_chunk: int) -> list[tuple[int, int]]:
    return [(t0, min(t0 + per_chunk, frames)) for t0 in range(0, frames, per_chunk)]


def pump_converted(
    source: FrameSource,
    out_fd: int,
    per_chunk: int,
    *,
    check: Callable[[], None] = lambda: None,
) -> int:
    """Convert ``source`` chunk by chunk into staging and sendfile each chunk to ``out_fd``.

    Chunk k+1 is converted on a helper thread while chunk k is sent (both
    release the GIL). Returns the bytes sent. ``check`` runs between chunks and
    may raise to stop (cancellation).
    """
    g = source.geometry
    frame_bytes = 3 * g.height * g.width
    spans = chunk_spans(g.frames, per_chunk)
    scratch: list[torch.Tensor] = []  # float scaling space, for sources we must not write
    planes = torch.empty(BLOCK_BYTES, dtype=torch.uint8)  # the cast, before the interleave

    def convert(slot: int, t0: int, t1: int) -> int:
        nbytes = (t1 - t0) * frame_bytes
        out = staging.slot(slot, nbytes).view(t1 - t0, g.height, g.width, 3)
        try:
            for a, b, r0, r1 in blocks(g, t0, t1):
                block, owned = source.read(a, b, r0, r1)
                if not owned and block.dtype != torch.uint8 and not scratch:
                    scratch.append(torch.empty(BLOCK_BYTES, dtype=block.dtype))
                convert_into(
                    block,
                    g.layout,
                    out[a - t0 : b - t0, r0:r1],
                    scratch=scratch[0] if scratch else None,
                    planes=planes,
                    inplace=owned,
                )
        finally:
            del out  # no view of the mapping may outlive the call
        return nbytes

    sent = 0
    with (
        Staging(per_chunk * frame_bytes, in_flight=pipe_capacity(out_fd)) as staging,
        ThreadPoolExecutor(1, thread_name_prefix="framewire-convert") as pool,
    ):
        pending: Future[int] | None = pool.submit(convert, 0, *spans[0])
        try:
            for i in range(len(spans)):
                assert pending is not None
                nbytes = pending.result()
                pending = (
                    pool.submit(convert, (i + 1) % 2, *spans[i + 1]) if i + 1 < len(spans) else None
                )
                check()
                send_all(out_fd, staging.fd, (i % 2) * staging.slot_bytes, nbytes)
                sent += nbytes
        finally:
            # The converter writes into the mapping: it must be done before the unmap.
            if pending is not None:
                pending.cancel()
                with contextlib.suppress(BaseException):
                    pending.result()
    return sent
