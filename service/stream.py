"""Staging memfds and the sendfile pump that feeds ffmpeg's stdin.

Each encode owns its staging memfd (never shared between jobs). ``sendfile``
into a pipe does not copy: the pipe keeps references to the memfd's pages until
ffmpeg reads them. Rewriting a slot whose pages may still sit in the pipe would
change bytes ffmpeg has not read yet, so every slot is punched out
(``MADV_REMOVE``) before it is written again; the pipe keeps the old pages, the
next write gets fresh ones.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import select
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from framewire.client.errors import BadRequest

from .convert import convert_into
from .ffmpeg import FfmpegExited
from .sources import FrameSource

PIPE_BYTES = 1 << 20  # fewer wakeups per chunk than the 64 KiB default
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def widen_pipe(fd: int) -> None:
    try:
        fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:
        pass  # capped by /proc/sys/fs/pipe-max-size: the default still works


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
    """A private memfd with ``slots`` equal slots, mapped and seen as uint8 tensors."""

    def __init__(self, slot_bytes: int, slots: int = 2):
        # Page-aligned slots: MADV_REMOVE works on whole pages.
        self.slot_bytes = -(-slot_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.fd = os.memfd_create("framewire-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.slot_bytes * slots)
            self._map = mmap.mmap(self.fd, self.slot_bytes * slots)
        except BaseException:
            os.close(self.fd)
            raise

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        """Slot ``index`` emptied of old pages, as a writable uint8 tensor of ``nbytes``."""
        start = index * self.slot_bytes
        self._map.madvise(mmap.MADV_REMOVE, start, self.slot_bytes)
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
    scratch: list[torch.Tensor] = []

    def convert(slot: int, t0: int, t1: int) -> int:
        nbytes = (t1 - t0) * frame_bytes
        out = staging.slot(slot, nbytes).view(t1 - t0, g.height, g.width, 3)
        try:
            chunk, owned = source.read(t0, t1)
            if not owned and chunk.dtype != torch.uint8 and not scratch:
                scratch.append(torch.empty(per_chunk * frame_bytes, dtype=chunk.dtype))
            convert_into(
                chunk, g.layout, out, scratch=scratch[0] if scratch else None, inplace=owned
            )
        finally:
            del out  # no view of the mapping may outlive the call
        return nbytes

    sent = 0
    with (
        Staging(per_chunk * frame_bytes) as staging,
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
