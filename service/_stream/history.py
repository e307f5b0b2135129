"""What a live view has said so far: the init segment and the fragments after it, kept
for late joiners of ``live.mp4`` and served as HLS segments and parts.

A fragment that begins with a keyframe starts a segment; the fragments after it, up to
the next such one, are that segment's parts, in order. Segments are numbered from 0 at
the session's first fragment (HLS media sequence numbers), parts from 0 in each.

Bounds: about ``bound`` bytes (``FRAMEWIRE_LIVE_HISTORY_BYTES``). Past it, whole
segments leave from the front (a late viewer then starts at a later keyframe: the
GOP is 250 frames); the segment being written always stays. Past twice the bound in
that one segment alone (no keyframe to start at), the history is released, and
joiners are refused from then on.
"""

from __future__ import annotations

from dataclasses import dataclass

HISTORY_BYTES = 32 << 20  # the bound when none is given


@dataclass(frozen=True)
class Fragment:
    data: bytes  # moof + mdat
    frames: int  # video frames in it
    msn: int  # the segment it belongs to
    part: int  # its place in that segment; 0 begins with a keyframe


class History:
    def __init__(self, bound: int | None = None) -> None:
        self.bound = bound or HISTORY_BYTES
        self.init: bytes | None = None  # ftyp + moov
        self.segments: dict[int, list[Fragment]] = {}  # by msn, oldest first
        self.bytes = 0
        self.released = False
        self.last_msn = -1  # the segment being written (the newest)
        self._parts = 0  # fragments of it so far

    def add_init(self, data: bytes) -> None:
        self.init = data
        self.bytes += len(data)

    def add(self, data: bytes, frames: int, key: bool) -> Fragment:
        """Keep a fragment (``key``: it begins with a keyframe) and trim to the bound."""
        if key or self.last_msn < 0:  # the encode's first fragment starts one either way
            self.last_msn += 1
            self._parts = 0
        fragment = Fragment(data, frames, self.last_msn, self._parts)
        self._parts += 1
        if self.released:
            return fragment
        self.segments.setdefault(self.last_msn, []).append(fragment)
        self.bytes += len(data)
        while self.bytes > self.bound and len(self.segments) > 1:
            for old in self.segments.pop(next(iter(self.segments))):
                self.bytes -= len(old.data)
        if self.bytes > 2 * self.bound:
            self.release()
        return fragment

    def release(self) -> None:
        self.segments.clear()
        self.bytes = 0
        self.released = True

    @property
    def first_msn(self) -> int:
        """The oldest segment kept (the newest when none is)."""
        return next(iter(self.segments), max(self.last_msn, 0))

    def replay(self) -> list[bytes]:
        """What a viewer who joins now receives first: the init segment and every
        fragment kept (shared bytes, not copies)."""
        out = [] if self.init is None else [self.init]
        for segment in self.segments.values():
            out += [fragment.data for fragment in segment]
        return out

    def fragment(self, msn: int, part: int) -> Fragment | None:
        segment = self.segments.get(msn, [])
        return segment[part] if 0 <= part < len(segment) else None
