"""The HLS media-playlist checker the live view's tests lean on: good playlists (live with
parts, ended live, VOD) pass and give their structure back; each broken rule is named."""

from __future__ import annotations

import pytest

from tests.support.hls_check import Part, PlaylistError, check_media_playlist

# The server's example: the first segment complete, the second one part in.
BRIEF = """#EXTM3U
#EXT-X-VERSION:7
#EXT-X-TARGETDURATION:11
#EXT-X-PART-INF:PART-TARGET=0.125
#EXT-X-SERVER-CONTROL:CAN-BLOCK-RELOAD=YES,PART-HOLD-BACK=0.375
#EXT-X-INDEPENDENT-SEGMENTS
#EXT-X-MEDIA-SEQUENCE:0
#EXT-X-MAP:URI="live/init.mp4"
#EXT-X-PART:DURATION=0.125,URI="live/0.0.m4s",INDEPENDENT=YES
#EXT-X-PART:DURATION=0.125,URI="live/0.1.m4s"
#EXTINF:0.25000,
live/0.m4s
#EXT-X-PART:DURATION=0.125,URI="live/1.0.m4s",INDEPENDENT=YES
#EXT-X-PRELOAD-HINT:TYPE=PART,URI="live/1.1.m4s"
"""

Q = "?exp=1700000000&sig=0f0f"
# A window of four segments (5 to 8) and the ninth in progress; parts listed for 7 and 8.
LIVE = f"""#EXTM3U
#EXT-X-VERSION:7
#EXT-X-TARGETDURATION:1
#EXT-X-PART-INF:PART-TARGET=0.25
#EXT-X-SERVER-CONTROL:CAN-BLOCK-RELOAD=YES,PART-HOLD-BACK=0.75,HOLD-BACK=3
#EXT-X-INDEPENDENT-SEGMENTS
#EXT-X-MEDIA-SEQUENCE:5
#EXT-X-MAP:URI="live/init.mp4{Q}"
#EXTINF:1.00000,
live/5.m4s{Q}
#EXTINF:1.00000,
live/6.m4s{Q}
#EXT-X-PART:DURATION=0.25,URI="live/7.0.m4s{Q}",INDEPENDENT=YES
#EXT-X-PART:DURATION=0.25,URI="live/7.1.m4s{Q}"
#EXT-X-PART:DURATION=0.25,URI="live/7.2.m4s{Q}"
#EXT-X-PART:DURATION=0.25,URI="live/7.3.m4s{Q}"
#EXTINF:1.00000,
live/7.m4s{Q}
#EXT-X-PART:DURATION=0.25,URI="live/8.0.m4s{Q}",INDEPENDENT=YES
#EXT-X-PART:DURATION=0.25,URI="live/8.1.m4s{Q}"
#EXT-X-PART:DURATION=0.25,URI="live/8.2.m4s{Q}"
#EXT-X-PART:DURATION=0.20833,URI="live/8.3.m4s{Q}"
#EXTINF:0.95833,
live/8.m4s{Q}
#EXT-X-PART:DURATION=0.25,URI="live/9.0.m4s{Q}",INDEPENDENT=YES
#EXT-X-PART:DURATION=0.25,URI="live/9.1.m4s{Q}"
#EXT-X-PRELOAD-HINT:TYPE=PART,URI="live/9.2.m4s{Q}"
"""

# The same stream once its producer finished: the last segment closed, no hint, ENDLIST.
ENDED_LIVE = LIVE.replace(
    f'#EXT-X-PRELOAD-HINT:TYPE=PART,URI="live/9.2.m4s{Q}"\n',
    f"#EXTINF:0.50000,\nlive/9.m4s{Q}\n#EXT-X-ENDLIST\n",
)

# What ffmpeg's hls muxer writes for an fMP4 VOD (with independent_segments).
VOD = """#EXTM3U
#EXT-X-VERSION:7
#EXT-X-TARGETDURATION:1
#EXT-X-MEDIA-SEQUENCE:0
#EXT-X-PLAYLIST-TYPE:VOD
#EXT-X-INDEPENDENT-SEGMENTS
#EXT-X-MAP:URI="init.mp4"
#EXTINF:1.000000,
out0.m4s
#EXTINF:0.500000,
out1.m4s
#EXT-X-ENDLIST
"""


def _edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def _without(text: str, old: str) -> str:
    return _edit(text, old, "")


def _moved(text: str, line: str, after: str) -> str:
    """``text`` with ``line`` taken out and put back after ``after``."""
    return _edit(_without(text, line), after, after + line)


def _twice(text: str, line: str) -> str:
    return _edit(text, line, line * 2)


def _rules(text: str, **kw: bool) -> set[str]:
    with pytest.raises(PlaylistError) as caught:
        check_media_playlist(text, **kw)
    assert isinstance(caught.value, AssertionError)
    return caught.value.rules


def test_the_servers_example_passes() -> None:
    p = check_media_playlist(BRIEF)
    assert (p.version, p.target_duration, p.media_sequence) == (7, 11, 0)
    assert (p.part_target, p.part_hold_back, p.can_block_reload) == (0.125, 0.375, True)
    assert p.independent_segments and p.map_uri == "live/init.mp4" and not p.ended
    [segment] = p.segments
    assert (segment.msn, segment.duration, segment.uri) == (0, 0.25, "live/0.m4s")
    assert [q.uri for q in segment.parts] == ["live/0.0.m4s", "live/0.1.m4s"]
    assert p.pending_parts == [Part(0.125, "live/1.0.m4s", True)]
    assert p.preload_hint == "live/1.1.m4s" and p.next_msn == 1


def test_a_live_window_passes() -> None:
    p = check_media_playlist(LIVE)
    assert [s.msn for s in p.segments] == [5, 6, 7, 8]
    assert [len(s.parts) for s in p.segments] == [0, 0, 4, 4]
    assert p.segments[2].uri == f"live/7.m4s{Q}" and p.map_uri == f"live/init.mp4{Q}"
    assert [q.independent for q in p.segments[3].parts] == [True, False, False, False]
    assert len(p.pending_parts) == 2 and p.preload_hint == f"live/9.2.m4s{Q}"
    assert p.next_msn == 9 and p.duration == pytest.approx(4.45833)


def test_an_ended_live_playlist_and_a_vod_pass() -> None:
    p = check_media_playlist(ENDED_LIVE)
    assert p.ended and p.preload_hint is None and p.pending_parts == []
    assert p.segments[-1].msn == 9 and len(p.segments[-1].parts) == 2
    v = check_media_playlist(VOD)
    assert v.ended and v.part_target is None and not v.can_block_reload
    assert [(s.msn, s.duration) for s in v.segments] == [(0, 1.0), (1, 0.5)]


def test_comments_blank_lines_and_rounding_tolerances_pass() -> None:
    text = _edit(LIVE, "#EXTINF:1.00000,\nlive/5", "# a comment\n\n#EXTINF:1.49999,\nlive/5")
    text = _edit(text, 'DURATION=0.25,URI="live/9.1', 'DURATION=0.2505,URI="live/9.1')
    check_media_playlist(text)


def test_the_part_floor_is_a_flag_and_spares_independent_parts() -> None:
    short = _edit(LIVE, 'DURATION=0.25,URI="live/9.1', 'DURATION=0.1,URI="live/9.1')
    check_media_playlist(short)  # the newest part may be its segment's last: spared
    hint = f'#EXT-X-PRELOAD-HINT:TYPE=PART,URI="live/9.2.m4s{Q}"'
    more = f'#EXT-X-PART:DURATION=0.25,URI="live/9.2.m4s{Q}"\n' + hint.replace("9.2", "9.3")
    short = _edit(short, hint, more)  # now one follows it in its segment: not spared
    assert _rules(short) == {"part-floor"}
    check_media_playlist(short, strict_part_floor=False)
    # A keyframe in the middle of a segment starts a part: the independent one may be short.
    keyed = _edit(LIVE, 'DURATION=0.25,URI="live/9.1', 'DURATION=0.1,URI="live/9.1')
    keyed = _edit(keyed, f'live/9.1.m4s{Q}"', f'live/9.1.m4s{Q}",INDEPENDENT=YES')
    check_media_playlist(keyed)


SEG5 = f"#EXTINF:1.00000,\nlive/5.m4s{Q}\n"
SEG7_PARTS = "".join(
    f'#EXT-X-PART:DURATION=0.25,URI="live/7.{i}.m4s{Q}"{",INDEPENDENT=YES" * (i == 0)}\n'
    for i in range(4)
)
SC = "#EXT-X-SERVER-CONTROL:CAN-BLOCK-RELOAD=YES,PART-HOLD-BACK=0.75,HOLD-BACK=3"

BAD: dict[str, tuple[str, set[str]]] = {
    "no EXTM3U first": (_without(LIVE, "#EXTM3U\n"), {"extm3u-first"}),
    "version 6": (_edit(LIVE, "VERSION:7", "VERSION:6"), {"version"}),
    "no version": (_without(LIVE, "#EXT-X-VERSION:7\n"), {"version"}),
    "no target duration": (_without(VOD, "#EXT-X-TARGETDURATION:1\n"), {"target-duration"}),
    "decimal target duration": (_edit(LIVE, "TARGETDURATION:1", "TARGETDURATION:1.5"),
                                {"target-duration"}),
    "EXTINF rounds above the target": (_edit(LIVE, "#EXTINF:1.00000,", "#EXTINF:1.5,"),
                                       {"extinf-le-target"}),
    "EXTINF without its comma": (_edit(VOD, "#EXTINF:1.000000,", "#EXTINF:1.000000"),
                                 {"extinf"}),
    "zero EXTINF": (_edit(VOD, "#EXTINF:1.000000,", "#EXTINF:0,"), {"positive-duration"}),
    "media sequence after a segment": (_moved(VOD, "#EXT-X-MEDIA-SEQUENCE:0\n", "out0.m4s\n"),
                                       {"media-sequence"}),
    "no independent segments": (_without(LIVE, "#EXT-X-INDEPENDENT-SEGMENTS\n"),
                                {"independent-segments"}),
    "no map": (_without(VOD, '#EXT-X-MAP:URI="init.mp4"\n'), {"map-first"}),
    "map after a segment": (_moved(VOD, '#EXT-X-MAP:URI="init.mp4"\n', "out0.m4s\n"),
                            {"map-first"}),
    "map URI unquoted": (_edit(VOD, 'URI="init.mp4"', "URI=init.mp4"), {"map-first"}),
    "EXTINF without URI": (_without(LIVE, f"live/5.m4s{Q}\n"), {"extinf-uri"}),
    "last EXTINF without URI": (_without(VOD, "out1.m4s\n"), {"extinf-uri"}),
    "URI without EXTINF": (_without(LIVE, "#EXTINF:1.00000,\n"), {"uri-extinf"}),
    "ENDLIST not last": (_moved(VOD, "#EXT-X-ENDLIST\n", "out0.m4s\n"), {"endlist-last"}),
    "ENDLIST with pending parts": (_edit(LIVE, f'#EXT-X-PRELOAD-HINT:TYPE=PART,URI="live/9.2.m4s'
                                         f'{Q}"\n', "#EXT-X-ENDLIST\n"), {"endlist-last"}),
    "ENDLIST after a hint": (LIVE + "#EXT-X-ENDLIST\n", {"endlist-last", "preload-hint"}),
    "target duration twice": (_twice(LIVE, "#EXT-X-TARGETDURATION:1\n"), {"tag-once"}),
    "independent segments twice": (_twice(VOD, "#EXT-X-INDEPENDENT-SEGMENTS\n"), {"tag-once"}),
    "unknown tag": (_edit(VOD, "out1.m4s\n", "out1.m4s\n#EXT-X-DISCONTINUITY\n"), {"known-tags"}),
    "bad playlist type": (_edit(VOD, "TYPE:VOD", "TYPE:LIVE"), {"playlist-type"}),
    "unterminated quote": (_edit(VOD, 'URI="init.mp4"', 'URI="init.mp4'), {"attribute-list"}),
    "attributes without a comma": (_edit(LIVE, "TYPE=PART,URI", "TYPE=PART URI"),
                                   {"attribute-list"}),
    "an attribute twice": (_edit(VOD, 'URI="init.mp4"', 'URI="init.mp4",URI="init.mp4"'),
                           {"attribute-list"}),
    "parts without PART-INF": (_without(LIVE, "#EXT-X-PART-INF:PART-TARGET=0.25\n"),
                               {"part-inf"}),
    "no server control": (_without(LIVE, SC + "\n"), {"server-control", "part-hold-back"}),
    "no blocking reload": (_edit(LIVE, "CAN-BLOCK-RELOAD=YES", "CAN-BLOCK-RELOAD=NO"),
                           {"server-control"}),
    "part hold back under 2 parts": (_edit(LIVE, "PART-HOLD-BACK=0.75", "PART-HOLD-BACK=0.4"),
                                     {"part-hold-back"}),
    "hold back under 3 targets": (_edit(LIVE, "HOLD-BACK=3", "HOLD-BACK=2"), {"hold-back"}),
    "a part over the target": (
        _edit(_edit(LIVE, 'DURATION=0.25,URI="live/8.0', 'DURATION=0.26,URI="live/8.0'),
              'DURATION=0.25,URI="live/8.1', 'DURATION=0.24,URI="live/8.1'),
        {"part-le-target"},
    ),
    "a short middle part": (
        _edit(_edit(LIVE, 'DURATION=0.25,URI="live/7.1', 'DURATION=0.2,URI="live/7.1'),
              'DURATION=0.25,URI="live/7.3', 'DURATION=0.3,URI="live/7.3'),
        {"part-floor", "part-le-target"},
    ),
    "parts not summing to EXTINF": (
        _edit(LIVE, 'DURATION=0.25,URI="live/7.3', 'DURATION=0.2,URI="live/7.3'), {"part-sum"}
    ),
    "a segment's first part not independent": (
        _edit(LIVE, f'live/7.0.m4s{Q}",INDEPENDENT=YES', f'live/7.0.m4s{Q}"'),
        {"part-first-independent"},
    ),
    "the pending first part not independent": (
        _edit(LIVE, f'live/9.0.m4s{Q}",INDEPENDENT=YES', f'live/9.0.m4s{Q}"'),
        {"part-first-independent"},
    ),
    "parts of an old segment": (
        _edit(LIVE, SEG5, SEG7_PARTS.replace("/7.", "/5.") + SEG5), {"part-window"}
    ),
    "two part hints": (LIVE + f'#EXT-X-PRELOAD-HINT:TYPE=PART,URI="live/9.3.m4s{Q}"\n',
                       {"preload-hint"}),
    "a hint before the last part": (
        _edit(LIVE, f'#EXT-X-PART:DURATION=0.25,URI="live/9.1.m4s{Q}"\n#EXT-X-PRELOAD-HINT'
                    f':TYPE=PART,URI="live/9.2.m4s{Q}"\n',
              f'#EXT-X-PRELOAD-HINT:TYPE=PART,URI="live/9.2.m4s{Q}"\n#EXT-X-PART:DURATION=0.25,'
              f'URI="live/9.1.m4s{Q}"\n'),
        {"preload-hint"},
    ),
    "a hint of no type": (_without(LIVE, "TYPE=PART,"), {"preload-hint"}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_each_broken_rule_is_named(case: str) -> None:
    text, rules = BAD[case]
    assert _rules(text) == rules


def test_the_message_names_the_rule_and_the_line() -> None:
    with pytest.raises(AssertionError, match=r"\[version\] EXT-X-VERSION must be 7.*\(line 2\)"):
        check_media_playlist(_edit(LIVE, "VERSION:7", "VERSION:3"))
