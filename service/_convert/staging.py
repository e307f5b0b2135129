"""Staging memfds: where converted frames wait to be sent, and who fills them.

Each encode owns its staging memfd (never shared between jobs). ``sendfile``
into a pipe does not copy: the pipe keeps references to the memfd's pages until
ffmpeg reads them. Rewriting such a page would change bytes ffmpeg has not read
yet. A pipe references at most its capacity in pages, always the most recently
sent ones, so before a slot is rewritten the tail of what it last sent (pipe
capacity plus a page) is punched out (``MADV_REMOVE``): the pipe keeps the old
pages, the next write gets fresh ones. Punching whole slots would cost a page
fault and a zero-fill per page of every chunk.

Staging that a GPU copies into is page-locked (``cudaHostRegister``), and
punching a page-locked page would leave the GPU writing to a page the memfd no
longer holds. Such slots are never punched: a slot is rewritten only once the
reader has consumed every byte it last sent (``pump.PipeDrain``).

What fills a slot is pluggable (:class:`ChunkWriter`): the host converter
(``pump.HostWriter``), or a source's own (the GPU's).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable

import torch
from framewire.core.closing import Closing

SLOT_TARGET = 8 << 20  # staging bytes per chunk: small enough to start ffmpeg early
REFUSED = "refused"  # ``Staging.pinned_on`` of a staging the driver would not page-lock


class Staging(Closing):
    """A private memfd with ``slots`` equal slots, mapped and seen as uint8 tensors.

    ``in_flight``: how many bytes sent from it the reader may still hold by
    reference (the pipe's capacity); None means any of them.
    """

    def __init__(self, slot_bytes: int, slots: int = 2, *, in_flight: int | None = None):
        # Page-aligned slots: MADV_REMOVE works on whole pages.
        self.slot_bytes = -(-slot_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.size = self.slot_bytes * slots
        self.in_flight = in_flight
        self.pinned_on: object = None  # the CUDA device it is page-locked for, once it is
        self._before_close: list[Callable[[], None]] = []
        self._sent = [0] * slots
        self.fd = os.memfd_create("framewire-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self._map = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise

    @property
    def locked(self) -> bool:
        """Page-locked for a GPU's copies: its slots must never be punched."""
        return self.pinned_on not in (None, REFUSED)

    def address(self) -> int:
        """Where the mapping starts in this process (for page-locking it)."""
        view = torch.frombuffer(self._map, dtype=torch.uint8, count=1)
        try:
            return view.data_ptr()
        finally:
            del view

    def slot(self, index: int, nbytes: int, *, punch: bool = True) -> torch.Tensor:
        """Slot ``index`` as a writable uint8 tensor of ``nbytes``, safe to overwrite.

        ``punch=False``: the caller has made sure the reader is done with it (pinned slots).
        """
        start = index * self.slot_bytes
        sent = self._sent[index]
        if sent and punch:
            tail = sent if self.in_flight is None else min(sent, self.in_flight + mmap.PAGESIZE)
            lo = (start + sent - tail) // mmap.PAGESIZE * mmap.PAGESIZE
            hi = -(-(start + sent) // mmap.PAGESIZE) * mmap.PAGESIZE
            self._map.madvise(mmap.MADV_REMOVE, lo, hi - lo)
        self._sent[index] = nbytes
        return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=start)

    def before_close(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` (unpinning) before the mapping goes: once per staging, however
        many chunk writers used it."""
        self._before_close.append(undo)

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            while self._before_close:
                self._before_close.pop()()
        finally:
            self._close_map()

    def _close_map(self) -> None:
        try:
            self._map.close()
        except BufferError:
            pass  # a traceback still holds a slot view; the mapping goes with it
        os.close(self.fd)
        self.fd = -1


def slot_frames(height: int, width: int) -> int:
    return max(1, SLOT_TARGET // (3 * height * width))


class ChunkWriter:
    """Converts frames [t0, t1) of one source into (t, H, W, 3) uint8 host memory.

    One per encode, called from one thread at a time. ``write`` gets ``take``,
    which hands out the destination once it may be written: a writer that
    computes elsewhere first (on a GPU) asks for it last.
    """

    pinned = False  # set by ``open`` once it page-locked the staging: then never punched

    def open(self, staging: Staging | None, frames: int) -> None:
        """Before the first chunk; ``frames`` is the most any chunk holds. No staging: the
        destinations are plain host memory (the fallback route)."""

    def write(self, take: Callable[[], torch.Tensor], t0: int, t1: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """After the last chunk (or a failure), before the staging is unmapped."""
