"""Staging memfds: where converted frames wait to be sent, and who fills them.

Each encode owns its staging memfd while it runs (never shared between jobs); one
let go is kept for a later encode (``kept.KeptStaging``). ``sendfile``
into a pipe does not copy: the pipe keeps references to the memfd's pages until
ffmpeg reads them. Rewriting such a page would change bytes ffmpeg has not read
yet. A pipe references at most its capacity in pages, always the most recently
sent ones, so before a slot is rewritten the tail of what it last sent (pipe
capacity plus a page) is punched out (``MADV_REMOVE``): the pipe keeps the old
pages, the next write gets fresh ones. Punching whole slots would cost a page
fault and a zero-fill per page of every chunk; a slot whose last send was followed
by that much more is not punched at all (with slots ahead, the usual case).

Staging that a GPU copies into is page-locked (``cudaHostRegister``), and
punching a page-locked page would leave the GPU writing to a page the memfd no
longer holds. Such slots are never punched: a slot is rewritten only once the
reader has consumed every byte it last sent (``pump.PipeDrain``).

What fills a slot is pluggable (:class:`ChunkWriter`): the host converter
(``pump.HostWriter``), or a source's own (the GPU's).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

import torch
from framewire.core.closing import Closing
from framewire.service._convert.kept import KeptStaging, Memfd

SLOT_TARGET = 8 << 20  # staging bytes per chunk: small enough to start ffmpeg early
REFUSED = "refused"  # ``Staging.pinned_on`` of a staging the driver would not page-lock


class Staging(Closing):
    """A private memfd with ``slots`` equal slots, mapped and seen as uint8 tensors.

    ``in_flight``: how many bytes sent from it the reader may still hold by
    reference (the pipe's capacity); None means any of them. ``kept``: where the memfd
    comes from and goes back to (else it is made and unmapped here).
    """

    def __init__(
        self,
        slot_bytes: int,
        slots: int = 2,
        *,
        in_flight: int | None = None,
        kept: KeptStaging | None = None,
    ):
        # Page-aligned slots: MADV_REMOVE works on whole pages.
        self.slot_bytes = -(-slot_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.size = self.slot_bytes * slots
        self.in_flight = in_flight
        self.pinned_on: object = None  # the CUDA device it is page-locked for, once it is
        self._before_close: list[Callable[[], None]] = []
        self._sent = [0] * slots
        # Bytes whose sends into the pipe completed, in all (a slot's, or a producer's sent
        # as they are); and that count when each slot's last send completed (None: taken
        # since, its send not known to be over). Told through ``pump.PipeDrain`` (``sent``,
        # ``passed``); read by the punch and by ``pump.PipeDrain``.
        self.written = 0
        self.ends: list[int | None] = [0] * slots
        self._kept = kept
        self._memfd = Memfd.new(self.size) if kept is None else kept.take(self.size)
        self.fd, self._map = self._memfd.fd, self._memfd.map

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
        if punch:
            self._punch(index)
        self._sent[index] = nbytes
        self.ends[index] = None
        start = index * self.slot_bytes
        return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=start)

    def sent(self, index: int, nbytes: int) -> None:
        """Slot ``index``'s send of ``nbytes`` completed (the sending thread's word)."""
        self.written += nbytes
        self.ends[index] = self.written

    def passed(self, nbytes: int) -> None:
        """``nbytes`` sent into the pipe from elsewhere than a slot (a producer's pages)
        completed: they push the slots' last sends further out of the pipe."""
        self.written += nbytes

    def pipe_may_hold(self, index: int) -> bool:
        """Whether the pipe may still hold pages of slot ``index``'s last send: not once
        sends completed after it filled the pipe's capacity (the pipe holds at most that
        much of the latest sends)."""
        end = self.ends[index]
        if self.in_flight is None or end is None:
            return True
        return self.written - end < self.in_flight + mmap.PAGESIZE

    def _punch(self, index: int) -> None:
        """Punch out what the pipe may still hold of slot ``index``'s last send."""
        sent = self._sent[index]
        if sent and self.pipe_may_hold(index):
            start = index * self.slot_bytes
            tail = sent if self.in_flight is None else min(sent, self.in_flight + mmap.PAGESIZE)
            lo = (start + sent - tail) // mmap.PAGESIZE * mmap.PAGESIZE
            hi = -(-(start + sent) // mmap.PAGESIZE) * mmap.PAGESIZE
            self._map.madvise(mmap.MADV_REMOVE, lo, hi - lo)
            self._sent[index] = 0

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
        self.fd = -1
        # A page-locked staging's pages were the GPU's: it is not kept.
        if self._kept is None or self.pinned_on not in (None, REFUSED):
            self._memfd.close()
            return
        try:
            for index in range(len(self._sent)):
                self._punch(index)  # the next owner's pipe must not be this one's
        except BaseException:
            self._memfd.close()
            raise
        self._kept.give(self._memfd)


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
