"""Staging memfds kept between encodes, with their pages.

A fresh memfd's pages cost a fault and a zero-fill each the first time they are
written, and freeing them at the unmap costs as much again: 40 MiB of frames copied
into a fresh memfd took 18 ms here, into one already written 2.2 ms, and its unmap
11 ms. Every encode and stream session stages its frames, so a staging let go is kept
for the next one rather than unmapped.

What a kept memfd still holds is never read: a slot's bytes are sent only once they
have been written again (``Staging.slot``). The pages its last pipe may still
reference were punched out before it was kept (``Staging.close``). Page-locked
stagings are not kept. At most ``keep_bytes`` are kept, the oldest let go first, and
none longer than ``idle_s``: a worker that stops encoding gives the memory back.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from dataclasses import dataclass

from framewire.core.closing import Closing

IDLE_S = 30.0


@dataclass
class Memfd:
    """A staging memfd of ``size`` bytes and its mapping."""

    fd: int
    map: mmap.mmap
    size: int

    @classmethod
    def new(cls, size: int) -> Memfd:
        fd = os.memfd_create("framewire-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(fd, mmap.mmap(fd, size), size)
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:
            pass  # a traceback still holds a slot view; the mapping goes with it
        os.close(self.fd)


class KeptStaging(Closing):
    """The staging memfds no encode holds, kept for the next (at most ``keep_bytes``)."""

    def __init__(self, keep_bytes: int, idle_s: float = IDLE_S):
        self.keep_bytes = keep_bytes
        self.idle_s = idle_s
        self._kept: list[tuple[float, Memfd]] = []  # oldest first
        self._cond = threading.Condition()
        self._sweeper: threading.Thread | None = None
        self._closed = False

    @property
    def count(self) -> int:
        with self._cond:
            return len(self._kept)

    @property
    def kept_bytes(self) -> int:
        with self._cond:
            return sum(memfd.size for _, memfd in self._kept)

    def take(self, size: int) -> Memfd:
        """A memfd of at least ``size`` bytes: the smallest kept one that fits, else a new
        one of ``size``."""
        with self._cond:
            fits = [(m.size, i) for i, (_, m) in enumerate(self._kept) if m.size >= size]
            if fits:
                return self._kept.pop(min(fits)[1])[1]
        return Memfd.new(size)

    def give(self, memfd: Memfd) -> None:
        """Keep ``memfd`` for a later encode, letting the oldest go past ``keep_bytes``."""
        dropped: list[Memfd] = []
        with self._cond:
            if self._closed or memfd.size > self.keep_bytes:
                dropped.append(memfd)
            else:
                self._kept.append((time.monotonic(), memfd))
                total = sum(m.size for _, m in self._kept)
                while total > self.keep_bytes:
                    _, oldest = self._kept.pop(0)
                    total -= oldest.size
                    dropped.append(oldest)
                if self._sweeper is None:
                    self._sweeper = threading.Thread(
                        target=self._sweep, name="framewire-staging", daemon=True
                    )
                    self._sweeper.start()
                self._cond.notify_all()
        for m in dropped:
            m.close()  # unmapping frees the pages: not under the lock

    def _sweep(self) -> None:
        """Let go of what was kept longer than ``idle_s``; ends once nothing is kept."""
        while True:
            with self._cond:
                now = time.monotonic()
                expired = [m for since, m in self._kept if now - since >= self.idle_s]
                self._kept = [(s, m) for s, m in self._kept if now - s < self.idle_s]
                if not self._kept and not expired:
                    self._sweeper = None
                    return
                if not expired:
                    self._cond.wait(self._kept[0][0] + self.idle_s - now)
            for m in expired:
                m.close()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            kept, self._kept = self._kept, []
            self._cond.notify_all()
        for _, m in kept:
            m.close()
