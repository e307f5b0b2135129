"""A live view as HLS: the media playlist (RFC 8216 with fMP4 segments, and the
low-latency extensions of its second edition) over the view's history, and which
segment or part a request names.

Segments are the history's runs of fragments from one keyframe to the next, so each
plays on its own (``EXT-X-INDEPENDENT-SEGMENTS``); every fragment is a part. The
figures follow from the encode, which the byte-exact contract fixes:

- ``TARGETDURATION``: the longest a segment can be, x264's keyint (``GOP_FRAMES``,
  which every profile keeps: another changes the file) at the output's rate, rounded
  up: 11 s at 24 fps. Shorter segments would need keyframes the file does not have;
  players start within a part of the live edge anyway.
- ``PART-TARGET``: a fragment's length. ffmpeg ends a fragment at the first frame
  boundary at or past ``LIVE_FRAGMENT_US`` (3 frames, 0.125 s, at 24 fps).
- ``PART-HOLD-BACK``: three parts, as the specification advises.

Parts are listed for the segments that start within three target durations of the
playlist's end, as the specification asks; the next part is hinted
(``EXT-X-PRELOAD-HINT``) and a request for it waits until it is written.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from framewire.core.errors import BadRequest, NotFound
from framewire.core.media.argv import GOP_FRAMES, LIVE_FRAGMENT_US
from framewire.service._stream.history import History

PART_HOLD_BACK_PARTS = 3
# A request may wait this long for what it names (a blocking reload, the hinted part):
# the specification's bound is three target durations, which is half a minute at 24
# fps; players time a request out sooner.
BLOCK_MAX_S = 10.0
MEDIA_NAME = re.compile(r"init\.mp4|([0-9]{1,10})(?:\.([0-9]{1,10}))?\.m4s")


@dataclass(frozen=True)
class Timing:
    """The playlist's durations, from the output's frame rate."""

    rate: Fraction

    @property
    def target(self) -> int:
        return math.ceil(GOP_FRAMES / self.rate)

    @property
    def part_frames(self) -> int:
        return max(1, math.ceil(self.rate * LIVE_FRAGMENT_US / 1_000_000))

    @property
    def part_target(self) -> Fraction:
        return self.part_frames / self.rate

    def seconds(self, frames: int) -> str:
        return f"{float(frames / self.rate):.5f}"


@dataclass(frozen=True)
class Media:
    """What a media request names: the init segment (``msn`` None), a segment
    (``part`` None) or a part."""

    msn: int | None = None
    part: int | None = None

    @property
    def kind(self) -> str:
        return "init" if self.msn is None else "segment" if self.part is None else "part"


def media_named(name: str) -> Media:
    match = MEDIA_NAME.fullmatch(name)
    if match is None:
        raise NotFound(f"no HLS media {name!r}", code="segment_not_found")
    msn, part = match.groups()
    return Media(None if msn is None else int(msn), None if part is None else int(part))


def playlist(history: History, timing: Timing, *, ended: bool, query: str) -> str:
    """The media playlist now. ``query``: the signed URL's, carried by every URI (a
    player resolves them against the playlist's URL without its query)."""
    q = f"?{query}" if query else ""
    lines = [
        "#EXTM3U",
        "#EXT-X-VERSION:7",
        f"#EXT-X-TARGETDURATION:{timing.target}",
        f"#EXT-X-PART-INF:PART-TARGET={timing.seconds(timing.part_frames)}",
        "#EXT-X-SERVER-CONTROL:CAN-BLOCK-RELOAD=YES,PART-HOLD-BACK="
        + timing.seconds(PART_HOLD_BACK_PARTS * timing.part_frames),
        "#EXT-X-INDEPENDENT-SEGMENTS",
        f"#EXT-X-MEDIA-SEQUENCE:{history.first_msn}",
        f'#EXT-X-MAP:URI="live/init.mp4{q}"',
    ]
    segments = list(history.segments.items())
    # Frames from each segment's start to the playlist's end: parts only near the end.
    after, left = [], sum(f.frames for _, fragments in segments for f in fragments)
    for _, fragments in segments:
        after.append(left)
        left -= sum(f.frames for f in fragments)
    recent = 3 * timing.target * timing.rate
    for (msn, fragments), frames_to_end in zip(segments, after, strict=True):
        if frames_to_end <= recent:
            for f in fragments:
                independent = ",INDEPENDENT=YES" if f.part == 0 else ""
                lines.append(
                    f"#EXT-X-PART:DURATION={timing.seconds(f.frames)},"
                    f'URI="live/{msn}.{f.part}.m4s{q}"{independent}'
                )
        if msn < history.last_msn or ended:
            lines.append(f"#EXTINF:{timing.seconds(sum(f.frames for f in fragments))},")
            lines.append(f"live/{msn}.m4s{q}")
    if ended:
        lines.append("#EXT-X-ENDLIST")
    elif not history.released:
        msn = max(history.last_msn, 0)
        nxt = len(history.segments.get(msn, []))
        lines.append(f'#EXT-X-PRELOAD-HINT:TYPE=PART,URI="live/{msn}.{nxt}.m4s{q}"')
    return "\n".join(lines) + "\n"


def check_reload(history: History, timing: Timing, msn: int | None, part: int | None) -> None:
    """400 ``bad_hls_request`` for a blocking reload the specification says to refuse
    at once: a part with no segment, or one too far ahead of the playlist."""
    if msn is None:
        if part is not None:
            raise BadRequest("_HLS_part without _HLS_msn", code="bad_hls_request")
        return
    ahead_parts = 3 / timing.part_target if timing.part_target < 1 else 3  # its limit
    have = len(history.segments.get(msn, [])) if msn == history.last_msn else 0
    if msn > history.last_msn + 2 or (
        part is not None and msn >= history.last_msn and part - have > ahead_parts
    ):
        raise BadRequest(
            f"_HLS_msn={msn} _HLS_part={part} is too far ahead of the playlist "
            f"(its newest segment is {history.last_msn})",
            code="bad_hls_request",
        )


def complete_segments(history: History) -> int:
    """Segments listed whole in the live playlist (all but the one being written)."""
    return len(history.segments) - (history.last_msn in history.segments)


def reload_ready(history: History, msn: int, part: int | None) -> bool:
    """Whether the playlist now holds segment ``msn`` (whole when ``part`` is None, else
    up to that part)."""
    if part is None:
        return msn < history.last_msn
    newest = history.segments.get(history.last_msn, [])
    return msn < history.last_msn or (msn == history.last_msn and part < len(newest))


def media_state(history: History, media: Media, *, ended: bool) -> str:
    """``hit`` (it is kept), ``gone`` (the history moved past it), ``wait`` (the part
    the playlist hints, or the next segment's first, not written yet) or ``missing``."""
    msn = media.msn
    if msn is None:
        return "hit" if history.init is not None else "missing" if ended else "wait"
    if history.released or msn < history.first_msn:
        return "gone"
    if media.part is None:
        complete = msn < history.last_msn or (ended and msn == history.last_msn)
        return "hit" if complete and msn in history.segments else "missing"
    if history.fragment(msn, media.part) is not None:
        return "hit"
    newest = len(history.segments.get(history.last_msn, []))
    hinted = (msn == history.last_msn and media.part == newest) or (
        msn == history.last_msn + 1 and media.part == 0
    )
    return "wait" if hinted and not ended else "missing"


def media_pieces(history: History, media: Media) -> list[bytes]:
    """What ``media`` is made of: the history's own bytes (shared by every request, never
    copied: a segment is its fragments, in order)."""
    if media.msn is None:
        assert history.init is not None
        return [history.init]
    if media.part is None:
        return [f.data for f in history.segments[media.msn]]
    fragment = history.fragment(media.msn, media.part)
    assert fragment is not None
    return [fragment.data]
