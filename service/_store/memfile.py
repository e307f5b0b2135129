"""A memory output's memfd: where its encode writes (no file, no copy), held once whole.

The encoder names it ``/proc/self/fd/N`` (a child inherits it as it would a private
directory) and gives ffmpeg its muxer, since the name has no extension to pick one by.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from framewire.core.errors import Cancelled
from framewire.service._outputs import TempOutput, sha256_of
from framewire.service._store.handoff import Handoffs, MemoryTarget

# The muxer each output extension picks (core.media.argv.OUTPUT_EXTENSIONS): a memfd's
# name has no extension to pick it by.
MUXERS = {".mp4": "mp4", ".m4v": "ipod", ".mov": "mov", ".mkv": "matroska"}


@dataclass(frozen=True)
class MemfdOutput(TempOutput):
    """A memory output's memfd as the place its encode writes: ``fd`` is the memfd, named
    ``/proc/self/fd/<fd>`` (a child inherits it, as it would a private directory), and
    ``name`` the output's own, whose extension gives the muxer."""

    @property
    def path(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    @property
    def muxer(self) -> str | None:
        return MUXERS[os.path.splitext(self.name)[1].lower()]

    def digest(self) -> tuple[int, str]:
        # Opened again: a reader of its own, at its own offset.
        with open(os.open(self.path, os.O_RDONLY | os.O_CLOEXEC), "rb") as f:
            return sha256_of(f)


class MemoryHold:
    """A memory output's memfd, which its encode writes into (a follower of the encode:
    service/_outputs.py), so the hold after the encode seals the very bytes written: no
    spool file, no copy of it (85 MB: 35-53 ms here), nothing to remove. The owner of the
    output closes it when the output ends; a memfd not taken by then goes with it."""

    def __init__(self, target: MemoryTarget, handoffs: Handoffs | None = None):
        """``handoffs``: where a target with a reserved ticket is held once whole."""
        self.target = target
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        self._fd: int | None = os.memfd_create(f"framewire-output:{target.name}", flags)
        self._handoffs = handoffs
        self._kept = False  # held under the reserved ticket, until handed to the result
        self._lock = threading.Lock()

    def destination(self) -> TempOutput | None:
        """The memfd, where the encode writes (every route truncates it first)."""
        with self._lock:
            if self._fd is None:
                raise Cancelled("the output ended before its encode")
            return MemfdOutput(self._fd, self.target.name)

    def writing(self, temp: TempOutput) -> None:
        """Nothing to follow while the file is written."""

    def check(self) -> None:
        """Nothing can stop the encode from here."""

    def written(self, temp: TempOutput) -> None:
        """The file is whole: under a reserved ticket it is held now, while its digest runs
        (a take waiting on the ticket answers); else when the result is delivered. A hold
        refused (429) fails the output."""
        if self.target.ticket is None or self._handoffs is None:
            return
        with self._lock:
            if self._fd is None:
                return  # the output ended meanwhile
            # A descriptor of its own: once taken, the held one is gone, and the digest
            # and the checks still read the memfd through this hold's.
            held = os.dup(self._fd)
        self._handoffs.keep(held, os.fstat(held).st_size, self.target)
        self._kept = True

    def handed(self) -> str | None:
        """The ticket the output is held under already (the result's from now on), if any."""
        kept, self._kept = self._kept, False
        return self.target.ticket if kept else None

    def taken(self, size: int) -> int | None:
        """The memfd (the caller's from now on) if it holds ``size`` bytes, the digest's."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None and os.fstat(fd).st_size != size:
            os.close(fd)
            return None
        return fd

    def close(self) -> None:
        """The output ended: its memfd goes, held early or not, unless the result has it."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        if self._kept and self._handoffs is not None and self.target.ticket is not None:
            self._kept = False
            self._handoffs.drop(self.target.ticket)  # the output failed after it was whole
