"""A live feed's viewers, in one event loop: the slow one is dropped with its reason,
the others and the history go on; past its bound the history restarts at a keyframe,
read from real fragmented MP4."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
from fractions import Fraction
from pathlib import Path

import pytest
from framewire.core.errors import Conflict, Overloaded
from framewire.core.media.argv import LIVE_MOVFLAGS
from framewire.service._ops.metrics import Metrics
from framewire.service._stream import history, live
from framewire.service._stream.fmp4 import boxes, starts_with_keyframe, video_samples
from framewire.service._stream.live import LiveFeed, ViewerSlots

from tests.support.media import FFMPEG

RATE = Fraction(24)


def _sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_a_slow_viewer_is_dropped_and_the_others_go_on(monkeypatch):
    monkeypatch.setattr(live, "VIEWER_QUEUE_BYTES", 1000)
    metrics = Metrics()

    async def run() -> tuple[list[bytes], bytes, LiveFeed]:
        feed = LiveFeed("s", metrics, ViewerSlots(64), 60, RATE)
        slow, reader = feed.join(), feed.join()
        got: list[bytes] = []

        async def read() -> None:
            try:
                async for data in reader.stream():
                    got.append(data)
            finally:
                feed.leave(reader)

        task = asyncio.create_task(read())
        for i in range(10):
            feed._publish(bytes([i]) * 300, 0, False)
            await asyncio.sleep(0)
        assert slow.reason == "too_slow"
        left = b"".join([d async for d in slow.stream()])
        feed.leave(slow)
        await feed.close("finished")
        await asyncio.wait_for(task, 5)
        return got, left, feed

    got, left, feed = asyncio.run(run())
    # The reader got every fragment, then the end; the slow one only the news of its drop.
    assert b"".join(got[:-1]) == b"".join(bytes([i]) * 300 for i in range(10))
    assert json.loads(got[-1][8:])["reason"] == "finished"
    assert left[4:8] == b"free" and json.loads(left[8:])["reason"] == "too_slow"
    assert _sample(metrics, "framewire_live_drops_total", cause="too_slow") == 1
    assert _sample(metrics, "framewire_live_viewers") == 0
    assert _sample(metrics, "framewire_live_bytes_total") == 3000 + len(got[-1]) + len(left)
    assert not feed.viewers


def test_the_history_has_a_bound_and_viewers_a_cap(monkeypatch):
    monkeypatch.setattr(history, "HISTORY_BYTES", 500)
    monkeypatch.setattr(live, "VIEWERS_PER_STREAM", 2)

    async def run() -> None:
        feed = LiveFeed("s", Metrics(), ViewerSlots(64), 60, RATE)
        first = feed.join()
        feed.join()
        with pytest.raises(Overloaded):
            feed.join()
        feed._publish(bytes(600), 0, False)
        feed._publish(bytes(600), 0, False)  # past the bound, no keyframe to cut at: released
        assert feed.history.released
        feed.leave(first)
        with pytest.raises(Conflict, match="no longer kept"):
            feed.join()
        await feed.close("aborted")

    asyncio.run(run())


def test_ended_sessions_viewers_hold_their_slots_and_past_the_grace_nothing_else():
    metrics = Metrics()

    async def run() -> bytes:
        slots = ViewerSlots(2)
        ended = LiveFeed("a", metrics, slots, 0.05, RATE)
        other = LiveFeed("b", metrics, slots, 60, RATE)
        ended._publish(bytes(1000), 0, False)
        slow, quick = ended.join(), ended.join()
        await ended.close("finished")
        with pytest.raises(Overloaded, match="FRAMEWIRE_MAX_VIEWERS=2"):
            other.join()  # the ended session's viewers still count
        assert b"".join([d async for d in quick.stream()])[:1000] == bytes(1000)
        ended.leave(quick)
        other.leave(other.join())  # its slot came back
        await asyncio.sleep(0.2)  # the grace is over: what is left of the history goes
        left = b"".join([d async for d in slow.stream()])
        ended.leave(slow)
        assert slots.taken == 0
        return left

    left = asyncio.run(run())
    assert left[4:8] == b"free" and json.loads(left[8:])["reason"] == "too_slow"
    assert _sample(metrics, "framewire_live_drops_total", cause="too_slow") == 1


def _fragmented(tmp_path: Path) -> bytes:
    """A real fragmented MP4 as the live view's muxer writes it, a keyframe every 8
    frames and a fragment every frame (so most fragments start without one)."""
    out = tmp_path / "frag.mp4"
    subprocess.run(
        [FFMPEG, "-v", "error", "-f", "lavfi", "-i", "testsrc2=size=64x48:rate=24",
         "-frames:v", "48", "-c:v", "libx264", "-g", "8", "-pix_fmt", "yuv420p",
         "-movflags", LIVE_MOVFLAGS, "-frag_duration", "1", str(out)],
        check=True,
    )  # fmt: skip
    return out.read_bytes()


def test_fragments_that_start_with_a_keyframe_are_known(tmp_path):
    data = _fragmented(tmp_path)
    found = boxes(data)
    moofs = [data[a:b] for kind, a, b in found if kind == b"moof"]
    assert sum(video_samples(m) for m in moofs) == 48
    keys = [starts_with_keyframe(m) for m in moofs]
    frame_at = [sum(video_samples(m) for m in moofs[:i]) for i in range(len(moofs))]
    assert keys == [n % 8 == 0 for n in frame_at]
    assert keys.count(True) == 6


def test_past_its_bound_the_history_starts_at_a_keyframe(tmp_path, monkeypatch):
    data = _fragmented(tmp_path)
    found = boxes(data)
    first_moof = next(a for kind, a, _ in found if kind == b"moof")
    init = data[:first_moof]
    fragments = [data[a:c] for (k, a, _), (k2, _, c) in itertools.pairwise(found)
                 if k == b"moof" and k2 == b"mdat"]  # fmt: skip
    tail = sum(len(f) for f in fragments[-12:])  # room for a GOP and a half
    monkeypatch.setattr(history, "HISTORY_BYTES", len(init) + tail)

    async def run() -> bytes:
        feed = LiveFeed("s", Metrics(), ViewerSlots(64), 60, RATE)
        feed._publish_init(init)
        for fragment in fragments:
            moof = fragment[: boxes(fragment)[0][2]]
            feed._publish(fragment, video_samples(moof), starts_with_keyframe(moof))
        joiner = feed.join()
        await feed.close("finished")
        return b"".join([d async for d in joiner.stream()])

    late = asyncio.run(run())
    assert late.startswith(init) and len(late) < len(data)
    (tmp_path / "late.mp4").write_bytes(late)
    decoded = subprocess.run(
        [FFMPEG, "-v", "error", "-i", str(tmp_path / "late.mp4"), "-f", "framecrc", "-"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    frames = [line for line in decoded.stdout.splitlines() if not line.startswith("#")]
    # A whole number of GOPs from a keyframe on, decoded without an error.
    assert frames and len(frames) % 8 == 0 and len(frames) < 48 and decoded.stderr == ""
