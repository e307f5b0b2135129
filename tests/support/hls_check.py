"""A checker of HLS media playlists: RFC 8216 and the low-latency extensions of its
successor draft (8216bis: parts, preload hints, blocking reload), narrowed to what the
live view serves (fMP4 with EXT-X-MAP, version 7, no tags beyond ``ALLOWED_TAGS``).

``check_media_playlist`` parses a playlist and raises ``PlaylistError`` (an
``AssertionError``) naming every rule it breaks, one line each: ``[rule] what is wrong``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import datetime

VERSION = 7  # fMP4 segments with EXT-X-MAP need >= 6; the live view declares 7
PART_FLOOR = 0.85  # a part other than an independent or a segment's last: >= 85% of target
PART_WINDOW = 3  # parts older than 3 target durations from the end SHOULD be gone
EPSILON = 0.001  # durations are written in ms at best: 1 ms of rounding per value

# RFC 8216 4.3.3 and 4.3.5 (and the LL-HLS tags of the same sections of 8216bis).
ONCE_TAGS = frozenset(
    {
        "EXTM3U",
        "EXT-X-VERSION",
        "EXT-X-TARGETDURATION",
        "EXT-X-MEDIA-SEQUENCE",
        "EXT-X-PLAYLIST-TYPE",
        "EXT-X-INDEPENDENT-SEGMENTS",
        "EXT-X-ENDLIST",
        "EXT-X-PART-INF",
        "EXT-X-SERVER-CONTROL",
    }
)
# All the live view may write: those, and the tags of its segments and parts.
ALLOWED_TAGS = ONCE_TAGS | {
    "EXT-X-MAP",
    "EXT-X-PROGRAM-DATE-TIME",
    "EXTINF",
    "EXT-X-PART",
    "EXT-X-PRELOAD-HINT",
}

# RFC 8216 4.2: AttributeName=AttributeValue, the value a quoted string (no quote, CR or
# LF inside) or an unquoted run (integer, hex, decimal, enumerated string, resolution).
_ATTRIBUTE = re.compile(r'([A-Z0-9-]+)=("[^"\r\n]*"|[^",\s]+)')
_INTEGER = re.compile(r"[0-9]{1,20}")
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")


@dataclass(frozen=True)
class Part:
    duration: float
    uri: str
    independent: bool
    line: int = field(default=0, compare=False, repr=False)  # where the playlist lists it


@dataclass(frozen=True)
class Segment:
    msn: int
    duration: float
    uri: str
    parts: list[Part] = field(default_factory=list)


@dataclass(frozen=True)
class Playlist:
    version: int
    target_duration: int
    media_sequence: int
    part_target: float | None
    part_hold_back: float | None
    can_block_reload: bool
    independent_segments: bool
    map_uri: str | None
    segments: list[Segment]
    pending_parts: list[Part]  # the parts of the segment still being written
    preload_hint: str | None  # the URI of the TYPE=PART hint
    ended: bool

    @property
    def next_msn(self) -> int:
        """The media sequence number of the segment in progress (``_HLS_msn``)."""
        return self.media_sequence + len(self.segments)

    @property
    def duration(self) -> float:
        """Seconds from the first listed segment to the playlist's end, pending parts too."""
        return sum(s.duration for s in self.segments) + sum(p.duration for p in self.pending_parts)


class PlaylistError(AssertionError):
    """The rules a playlist breaks: ``failures`` holds (rule, message) pairs."""

    def __init__(self, failures: list[tuple[str, str]], text: str):
        self.failures = failures
        lines = "\n".join(f"[{rule}] {message}" for rule, message in failures)
        super().__init__(f"the media playlist breaks {len(failures)} rule(s):\n{lines}\n{text}")

    @property
    def rules(self) -> set[str]:
        return {rule for rule, _ in self.failures}


class _BadAttributes(Exception):
    pass


def parse_attributes(text: str) -> dict[str, str]:
    """An attribute list as name -> raw value (a quoted string keeps its quotes)."""
    attrs: dict[str, str] = {}
    at = 0
    while True:
        match = _ATTRIBUTE.match(text, at)
        if match is None:
            raise _BadAttributes(f"no AttributeName=AttributeValue at {text[at:]!r}")
        name, value = match.groups()
        if name in attrs:  # RFC 8216 4.2: MUST NOT hold one name twice
            raise _BadAttributes(f"{name} given twice")
        attrs[name] = value
        at = match.end()
        if at == len(text):
            return attrs
        if text[at] != ",":
            raise _BadAttributes(f"expected ',' after {name}, got {text[at:]!r}")
        at += 1


def _quoted(value: str | None) -> str | None:
    if value is None or len(value) < 2 or value[0] != '"' or value[-1] != '"':
        return None
    return value[1:-1]


def _decimal(value: str | None) -> float | None:
    return float(value) if value is not None and _DECIMAL.fullmatch(value) else None


def _integer(value: str | None) -> int | None:
    return int(value) if value is not None and _INTEGER.fullmatch(value) else None


def _rounded(seconds: float) -> int:
    return math.floor(seconds + 0.5)  # "rounded to the nearest integer": half up, not half even


class _Checker:
    def __init__(self, text: str, strict_part_floor: bool):
        self.text = text
        self.strict_part_floor = strict_part_floor
        self.failures: list[tuple[str, str]] = []
        self.counts: dict[str, int] = {}
        self.version: int | None = None
        self.target: int | None = None
        self.sequence: int | None = None
        self.part_target: float | None = None
        self.hold_back: float | None = None
        self.part_hold_back: float | None = None
        self.can_block_reload = False
        self.server_control = False
        self.map_uri: str | None = None
        self.hint: str | None = None
        self.hints = 0
        self.hint_line = 0
        self.ended_line = 0
        # (duration, uri, line) of each segment; the parts listed before its EXTINF.
        self.segments: list[tuple[float, str, int, list[Part]]] = []
        self.parts: list[Part] = []
        self.extinf: tuple[float, int] | None = None
        self.started = False  # a media segment's first tag (EXTINF or EXT-X-PART) was read

    def fail(self, rule: str, message: str, line: int = 0) -> None:
        self.failures.append((rule, f"{message} (line {line})" if line else message))

    def run(self) -> Playlist:
        lines = self.text.splitlines()
        if not lines or lines[0] != "#EXTM3U":
            first = lines[0] if lines else ""
            self.fail("extm3u-first", f"the first line must be #EXTM3U, not {first!r}", 1)
        last = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
        for number, raw in enumerate(lines, 1):
            line = raw.strip()
            if not line:
                continue
            if line.startswith("#EXT"):
                self.tag(line, number)
            elif line.startswith("#"):
                continue  # a comment
            else:
                self.uri(line, number)
            if self.ended_line and number > self.ended_line:
                self.fail("endlist-last", "EXT-X-ENDLIST must be the playlist's last line", number)
        if self.extinf is not None:
            self.fail("extinf-uri", "the last EXTINF has no URI line after it", self.extinf[1])
        if self.hint_line and self.hint_line != last:
            message = "EXT-X-PRELOAD-HINT must be the last line, after every part and segment"
            self.fail("preload-hint", message, self.hint_line)
        return self.finish()

    def tag(self, line: str, number: int) -> None:
        name, _, value = line[1:].partition(":")
        if name not in ALLOWED_TAGS:
            self.fail(
                "known-tags", f"unknown tag #{name} (allowed: {sorted(ALLOWED_TAGS)})", number
            )
            return
        self.counts[name] = self.counts.get(name, 0) + 1
        if name in ONCE_TAGS and self.counts[name] == 2:
            self.fail("tag-once", f"#{name} must appear at most once", number)
        handler = getattr(self, "tag_" + name.replace("-", "_").lower(), None)
        if handler is not None:
            try:
                handler(value, number)
            except _BadAttributes as exc:
                self.fail("attribute-list", f"#{name}: {exc}", number)

    def tag_ext_x_version(self, value: str, number: int) -> None:
        self.version = _integer(value)
        if self.version != VERSION:
            self.fail("version", f"EXT-X-VERSION must be {VERSION}, not {value!r}", number)

    def tag_ext_x_targetduration(self, value: str, number: int) -> None:
        self.target = _integer(value)
        if self.target is None:
            self.fail("target-duration", f"EXT-X-TARGETDURATION is no integer: {value!r}", number)

    def tag_ext_x_media_sequence(self, value: str, number: int) -> None:
        self.sequence = _integer(value)
        if self.sequence is None:
            self.fail("media-sequence", f"EXT-X-MEDIA-SEQUENCE is no integer: {value!r}", number)
        if self.started:
            self.fail("media-sequence", "EXT-X-MEDIA-SEQUENCE after the first segment", number)

    def tag_ext_x_playlist_type(self, value: str, number: int) -> None:
        if value not in ("VOD", "EVENT"):
            self.fail(
                "playlist-type", f"EXT-X-PLAYLIST-TYPE is VOD or EVENT, not {value!r}", number
            )

    def tag_ext_x_program_date_time(self, value: str, number: int) -> None:
        try:
            datetime.fromisoformat(value)
        except ValueError:
            self.fail("program-date-time", f"EXT-X-PROGRAM-DATE-TIME {value!r}", number)

    def tag_ext_x_map(self, value: str, number: int) -> None:
        uri = _quoted(parse_attributes(value).get("URI"))
        if uri is None:
            self.fail("map-first", 'EXT-X-MAP needs URI="..."', number)
        if self.started:
            self.fail("map-first", "EXT-X-MAP must come before the first segment", number)
        self.map_uri = self.map_uri or uri

    def tag_extinf(self, value: str, number: int) -> None:
        if self.extinf is not None:
            self.fail("extinf-uri", "EXTINF without a URI line after it", self.extinf[1])
        self.started = True
        seconds, comma, _ = value.partition(",")
        duration = _decimal(seconds)
        if duration is None or not comma:
            self.fail("extinf", f"EXTINF is <duration>,[<title>], not {value!r}", number)
            duration = 0.0
        elif duration <= 0:
            self.fail("positive-duration", f"EXTINF duration {seconds}", number)
        self.extinf = (duration, number)

    def tag_ext_x_endlist(self, value: str, number: int) -> None:
        self.ended_line = number

    def tag_ext_x_part_inf(self, value: str, number: int) -> None:
        self.part_target = _decimal(parse_attributes(value).get("PART-TARGET"))
        if not self.part_target:
            self.fail("part-inf", f"EXT-X-PART-INF needs PART-TARGET=<s>: {value!r}", number)

    def tag_ext_x_server_control(self, value: str, number: int) -> None:
        attrs = parse_attributes(value)
        self.server_control = True
        self.can_block_reload = attrs.get("CAN-BLOCK-RELOAD") == "YES"
        self.hold_back = _decimal(attrs.get("HOLD-BACK"))
        self.part_hold_back = _decimal(attrs.get("PART-HOLD-BACK"))
        for name in ("HOLD-BACK", "PART-HOLD-BACK", "CAN-SKIP-UNTIL"):
            if name in attrs and _decimal(attrs[name]) is None:
                self.fail("attribute-list", f"{name} is no decimal: {attrs[name]!r}", number)

    def tag_ext_x_part(self, value: str, number: int) -> None:
        attrs = parse_attributes(value)
        self.started = True
        duration = _decimal(attrs.get("DURATION"))
        uri = _quoted(attrs.get("URI"))
        if duration is None or uri is None:
            self.fail("part", f'EXT-X-PART needs DURATION=<s> and URI="...": {value!r}', number)
            return
        if duration <= 0:
            self.fail("positive-duration", f"EXT-X-PART DURATION {duration}", number)
        if self.extinf is not None:
            self.fail("extinf-uri", "EXT-X-PART between an EXTINF and its URI", number)
        if self.hint_line:
            self.fail("preload-hint", "EXT-X-PART after EXT-X-PRELOAD-HINT", number)
        independent = attrs.get("INDEPENDENT", "NO")
        if independent not in ("YES", "NO"):
            self.fail("attribute-list", f"INDEPENDENT is YES or NO, not {independent!r}", number)
        self.parts.append(Part(duration, uri, independent == "YES", number))

    def tag_ext_x_preload_hint(self, value: str, number: int) -> None:
        attrs = parse_attributes(value)
        kind, uri = attrs.get("TYPE"), _quoted(attrs.get("URI"))
        if kind not in ("PART", "MAP") or uri is None:
            self.fail("preload-hint", f'TYPE=PART|MAP and URI="..." needed: {value!r}', number)
            return
        if kind == "PART":
            self.hints += 1
            if self.hints > 1:
                self.fail("preload-hint", "more than one EXT-X-PRELOAD-HINT of TYPE=PART", number)
            self.hint, self.hint_line = uri, number

    def uri(self, line: str, number: int) -> None:
        if self.extinf is None:
            self.fail("uri-extinf", f"URI {line!r} with no EXTINF before it", number)
            return
        if self.hint_line:
            self.fail("preload-hint", "a segment after EXT-X-PRELOAD-HINT", number)
        duration, _ = self.extinf
        self.segments.append((duration, line, number, self.parts))
        self.parts, self.extinf = [], None

    def finish(self) -> Playlist:
        for name, rule in (
            ("EXT-X-VERSION", "version"),
            ("EXT-X-TARGETDURATION", "target-duration"),
        ):
            if name not in self.counts:
                self.fail(rule, f"#{name} is missing")
        if "EXT-X-INDEPENDENT-SEGMENTS" not in self.counts:
            self.fail("independent-segments", "#EXT-X-INDEPENDENT-SEGMENTS is missing")
        if self.started and "EXT-X-MAP" not in self.counts:
            self.fail("map-first", 'fMP4 segments need #EXT-X-MAP:URI="..." before them')
        ended = bool(self.ended_line)
        if ended and self.hint is not None:
            self.fail("endlist-last", "an ended playlist has no EXT-X-PRELOAD-HINT")
        if ended and self.parts:
            self.fail("endlist-last", "an ended playlist has no parts after its last segment")
        self.check_target()
        self.check_low_latency()
        sequence = self.sequence or 0
        segments = [
            Segment(sequence + i, duration, uri, parts)
            for i, (duration, uri, _, parts) in enumerate(self.segments)
        ]
        playlist = Playlist(
            version=self.version or 0,
            target_duration=self.target or 0,
            media_sequence=sequence,
            part_target=self.part_target,
            part_hold_back=self.part_hold_back,
            can_block_reload=self.can_block_reload,
            independent_segments="EXT-X-INDEPENDENT-SEGMENTS" in self.counts,
            map_uri=self.map_uri,
            segments=segments,
            pending_parts=self.parts,
            preload_hint=self.hint,
            ended=ended,
        )
        if self.failures:
            raise PlaylistError(self.failures, self.text)
        return playlist

    def check_target(self) -> None:
        if self.target is None:
            return
        for duration, _, number, _ in self.segments:
            if _rounded(duration) > self.target:
                self.fail(
                    "extinf-le-target",
                    f"EXTINF {duration} rounds above EXT-X-TARGETDURATION {self.target}",
                    number,
                )
        if self.hold_back is not None and self.hold_back + EPSILON < 3 * self.target:
            self.fail("hold-back", f"HOLD-BACK {self.hold_back} < 3 x target {self.target}")

    def check_low_latency(self) -> None:
        any_parts = self.parts or any(parts for *_, parts in self.segments)
        if not any_parts and self.part_target is None:
            return
        if self.part_target is None:
            if "EXT-X-PART-INF" not in self.counts:
                self.fail("part-inf", "EXT-X-PART without #EXT-X-PART-INF:PART-TARGET=<s>")
            return
        if not self.server_control or not self.can_block_reload:
            self.fail("server-control", "LL-HLS needs #EXT-X-SERVER-CONTROL:CAN-BLOCK-RELOAD=YES")
        if self.part_hold_back is None or self.part_hold_back + EPSILON < 2 * self.part_target:
            self.fail(
                "part-hold-back",
                f"PART-HOLD-BACK {self.part_hold_back} must be >= 2 x PART-TARGET "
                f"{self.part_target} (3 x recommended)",
            )
        end = sum(d for d, *_ in self.segments) + sum(p.duration for p in self.parts)
        at = 0.0
        for duration, uri, number, parts in self.segments:
            at += duration
            if parts:
                self.check_parts(parts, uri, complete=True)
                if abs(sum(p.duration for p in parts) - duration) > EPSILON * len(parts):
                    total = sum(p.duration for p in parts)
                    self.fail("part-sum", f"{uri}: parts sum to {total:.5f}, EXTINF {duration}")
                # Measured from the segment's end: its last part is the newest of them.
                if self.target and end - at > PART_WINDOW * self.target + EPSILON:
                    self.fail(
                        "part-window",
                        f"{uri} ends {end - at:.3f} s before the playlist's end, more than "
                        f"{PART_WINDOW} target durations: its parts should have been removed",
                        number,
                    )
        self.check_parts(self.parts, "the segment in progress", complete=False)

    def check_parts(self, parts: list[Part], owner: str, *, complete: bool) -> None:
        assert self.part_target is not None
        target = self.part_target
        if parts and "EXT-X-INDEPENDENT-SEGMENTS" in self.counts and not parts[0].independent:
            message = f"{owner}: its first part lacks INDEPENDENT=YES"
            self.fail("part-first-independent", message, parts[0].line)
        for i, part in enumerate(parts):
            if part.duration > target + EPSILON:
                message = f"{part.uri}: {part.duration} > PART-TARGET {target}"
                self.fail("part-le-target", message, part.line)
            # The last part of a segment may be short. So may the newest part of the segment
            # in progress: it may be that segment's last, which the server learns only when
            # the next keyframe's fragment arrives, in a later update.
            last = i == len(parts) - 1
            exempt = last or part.independent or not self.strict_part_floor
            if not exempt and part.duration + EPSILON < PART_FLOOR * target:
                self.fail(
                    "part-floor",
                    f"{part.uri}: {part.duration} < 85% of PART-TARGET {target}",
                    part.line,
                )


def check_media_playlist(text: str, *, strict_part_floor: bool = True) -> Playlist:
    """Parse a media playlist, asserting each rule (see the module docstring).

    ``strict_part_floor``: parts other than independent ones and the last of a segment
    are at least 85% of PART-TARGET (8216bis); off for servers cutting parts at frames.
    """
    return _Checker(text, strict_part_floor).run()
