"""The WAVs of audio from memory that the worker holds: one per distinct audio, shared.

An output or stream session that names audio samples holds its WAV until it ends.
Many of them often name the same samples (every rank's session, every output of
one request): one WAV is made per distinct content (its samples' sha256 and how
they are written) and handed out as leases, closed with the last one. The samples are read twice, a
block at a time: once for their digest (audio already held costs nothing more),
then, if new, into the WAV. What is held and being made is counted against
``FRAMEWIRE_AUDIO_BUDGET_BYTES``; past it, new audio is refused (``429
audio_budget_full``, to retry once others end). A WAV counts against the share of
the caller that made it (``FRAMEWIRE_USER_SHARE``): past it, that caller's new audio
is refused (``429 user_share``) while others' still fits.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from framewire.core.errors import BadRequest, Overloaded
from framewire.core.wire import AudioSource
from framewire.service._ops.shares import Share
from framewire.service._sources.audio import MemoryAudio, sample_blocks

RETRY_AFTER_S = 5.0


@dataclass(eq=False)
class _Held:
    key: tuple[object, ...]
    wav: MemoryAudio  # the one that owns the memfd
    nbytes: int
    user: int | None  # who made it (None: not limited)
    leases: int = 0


class AudioStore:
    def __init__(self, budget: int, per_user: int | None = None):
        """``per_user``: the bytes one limited caller's WAVs may count; None: no limit."""
        self.budget = budget
        self.share = Share(per_user, "FRAMEWIRE_AUDIO_BUDGET_BYTES", "bytes of audio")
        self._held: dict[tuple[object, ...], _Held] = {}
        self._counted = 0  # bytes of the WAVs held and of those being made
        self._lock = threading.Lock()  # leases are made and closed on pool threads

    def lease(
        self, src: AudioSource, fd: int, offset: int, *, clamp: bool, user: int | None = None
    ) -> MemoryAudio:
        """A WAV of ``src``'s samples at ``offset`` of ``fd``: the one held for the same
        content, or a new one (within the budget, and caller ``user``'s share of it).
        Close the lease to let go of it."""
        first = hashlib.sha256()
        for _ in sample_blocks(src, fd, offset, clamp=False, digest=first):
            pass  # a first read only to know the content: no copy kept
        with self._lock:
            held = self._held.get(_key(src, clamp, first))
            if held is not None:
                return self._lease(held)
        with self._counting(src.byte_size, user):
            written = hashlib.sha256()  # the caller may change its samples meanwhile
            made = MemoryAudio(src, sample_blocks(src, fd, offset, clamp=clamp, digest=written))
            key = _key(src, clamp, written)
            with self._lock:
                held = self._held.get(key)
                if held is None:
                    nbytes = made.data_offset + src.byte_size
                    held = self._held[key] = _Held(key, made, nbytes, user)
                    self._count(user, nbytes)
                    return self._lease(held)
                lease = self._lease(held)
        made.close()  # made at the same time by another request: theirs is used
        return lease

    @contextlib.contextmanager
    def _counting(self, nbytes: int, user: int | None) -> Iterator[None]:
        """Count ``nbytes`` while a WAV is made (refused past the budget or the share)."""
        if nbytes > self.budget:
            raise BadRequest(
                f"{nbytes} bytes of audio, over FRAMEWIRE_AUDIO_BUDGET_BYTES ({self.budget})",
                code="audio_too_large",
            )
        share = self.share.limit
        if user is not None and share is not None and nbytes > share:
            raise BadRequest(  # it would never fit
                f"{nbytes} bytes of audio, over one caller's share of the audio budget "
                f"({share}: FRAMEWIRE_USER_SHARE of FRAMEWIRE_AUDIO_BUDGET_BYTES)",
                code="audio_too_large",
            )
        with self._lock:
            if self._counted + nbytes > self.budget:
                raise Overloaded(
                    f"the worker holds {self._counted} bytes of audio; {nbytes} more would "
                    f"pass FRAMEWIRE_AUDIO_BUDGET_BYTES ({self.budget})",
                    code="audio_budget_full",
                    retry_after=RETRY_AFTER_S,
                )
            self.share.check(user, nbytes, RETRY_AFTER_S)
            self._count(user, nbytes)
        try:
            yield
        finally:
            with self._lock:
                self._count(user, -nbytes)

    def _count(self, user: int | None, nbytes: int) -> None:
        """(Under ``_lock``.)"""
        self._counted += nbytes
        self.share.add(user, nbytes)

    def _lease(self, held: _Held) -> MemoryAudio:
        """(Under ``_lock``.)"""
        held.leases += 1
        lease = copy.copy(held.wav)  # the same descriptor; closing it only lets go
        lease.release = lambda: self._let_go(held)
        return lease

    def _let_go(self, held: _Held) -> None:
        with self._lock:
            held.leases -= 1
            if held.leases:
                return
            del self._held[held.key]
            self._count(held.user, -held.nbytes)
        held.wav.close()


def _key(src: AudioSource, clamp: bool, digest: Any) -> tuple[object, ...]:
    """What makes two WAVs the same: the samples' bytes, and how they are written."""
    return (src.dtype, src.channels, src.sample_rate, src.samples, clamp, digest.digest())
