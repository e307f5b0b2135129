"""Small requests under load: while big encodes fill every CPU slot, a health probe and a
tiny encode stay fast; the small lane takes one tiny encode at a time, in arrival order."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
from framewire.client import Client
from framewire.service._encode.scheduler import Scheduler

from tests.service.encode.test_profiles import waveform
from tests.support.media import make_clip, reference_mp4
from tests.support.requests import RUNNING, WAITING, saved_on_thread, wait_for
from tests.support.worker import Worker

# ----------------------------------------------------------------------------- unit


def test_a_small_encode_takes_the_lane_only_when_the_slots_are_full():
    async def go() -> None:
        s = Scheduler(cpu_slots=1, max_queue=4)
        async with s.hold(1, small=True):  # the slot is free: it takes the slot
            assert (s.cpu_used, s._small_busy) == (1, False)
            async with s.hold(1, small=True) as waited:  # the slot is taken: the lane
                assert waited < 0.01 and s._small_busy and s.cpu_used == 1
            assert not s._small_busy

    asyncio.run(go())


def test_the_lane_runs_one_at_a_time_in_order_and_survives_cancels():
    async def go() -> list[str]:
        s = Scheduler(cpu_slots=1, max_queue=4)
        order: list[str] = []

        async def small(name: str) -> None:
            async with s.hold(1, small=True):
                order.append(f"start {name}")
                await asyncio.sleep(0.02)
            order.append(f"end {name}")

        async with s.hold(1):  # a big encode holds the only slot throughout
            first = asyncio.create_task(small("a"))
            await asyncio.sleep(0)
            gone = asyncio.create_task(small("gone"))
            late = asyncio.create_task(small("b"))
            await asyncio.sleep(0.005)
            gone.cancel()  # leaves the lane's line; b is next
            await asyncio.gather(first, late)
            with pytest.raises(asyncio.CancelledError):
                await gone
        assert not s._small_busy and not s._small_queue and s.cpu_used == 0
        return order

    assert asyncio.run(go()) == ["start a", "end a", "start b", "end b"]


# ----------------------------------------------------------------------------- end to end

TINY = dict(frames=2, height=48, width=64)  # 18 KiB of rgb24: small


def big_clip() -> Any:
    # About 3 s of placebo x264 on an idle core: ten times what the small work beside it
    # takes (six tiny encodes and their probes: 0.3 s), under load as on an idle host.
    return make_clip(frames=48, height=256, width=256)


def tiny_ms(c: Client, w: Worker, i: int) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    r = c.save_video(make_clip(**TINY, seed=i), f"tiny{i}.mp4", fps=24, threads=1)
    took = (time.perf_counter() - started) * 1e3
    (w.outputs / f"tiny{i}.mp4").unlink()
    return took, r.model_dump()


def under_a_big_encode(w: Worker, count: int) -> tuple[list[float], list[dict], dict, float]:
    """Idle tiny-encode latency, then ``count`` tiny encodes (and health probes) while a
    big encode holds the only slot; returns (their ms, their results, the big one's, idle
    median ms)."""
    results: dict[str, Any] = {}
    with Client(w.uds_url) as c, w.http() as h:
        idle = statistics.median(tiny_ms(c, w, 100 + i)[0] for i in range(5))
        big = saved_on_thread(w, big_clip(), "big.mp4", results, preset="placebo")
        wait_for(w, RUNNING, 1)
        times, tinies, health = [], [], []
        for i in range(count):
            took, result = tiny_ms(c, w, i)
            times.append(took)
            tinies.append(result)
            started = time.perf_counter()
            assert h.get("/healthz").status_code == 200
            health.append(time.perf_counter() - started)
        big.join(timeout=120)
    print(f"\ntiny encode idle {idle:.0f} ms; under load {[round(t) for t in times]} ms; "
          f"health max {max(health) * 1e3:.1f} ms")  # fmt: skip
    assert max(health) < 0.5, health  # on the event loop: no slot, no thread
    return times, tinies, results["big.mp4"], idle


def test_tiny_encodes_do_not_wait_for_a_big_one(workers, tmp_path):
    w = workers.start("--cpu-slots", "1")
    _, tinies, big, _ = under_a_big_encode(w, 6)  # their latencies: printed, not asserted
    assert big["ok"]
    for r in tinies:
        # Never queued behind it (a generous bound: the big one alone takes seconds)...
        assert r["ok"] and r["timings"]["queue_ms"] < 1000, r["timings"]
        # ...and done while the big encode still held the only slot: the order is the
        # claim. Their latency beside it is a figure: benchmarks/ranks.py measures it.
        assert r["timings"]["finished_at"] < big["timings"]["finished_at"], (r, big)
    clip = make_clip(**TINY, seed=0)
    assert tinies[0]["sha256"] == reference_mp4(clip, tmp_path / "ref.mp4", threads=1)


def encoder_of(w: Worker) -> int | None:
    """The worker's x264 child once it runs more than one thread (else None)."""
    for pid in w.children():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"libx264" in argv and len(list(Path(f"/proc/{pid}/task").iterdir())) > 1:
                return pid
        except OSError:
            continue  # gone (a version check, say)
    return None


POLICY = {os.SCHED_OTHER: "normal", os.SCHED_BATCH: "batch", os.SCHED_IDLE: "idle"}


def priority_of_threads(pid: int) -> set[tuple[int, str]]:
    """(niceness, policy) of every thread of ``pid``, from /proc (fields 19 and 41)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        found.add((int(fields[16]), POLICY[int(fields[38])]))
    return found


def running_encoder(w: Worker) -> int:
    """The worker's x264 child, once it runs with its threads made."""
    deadline = time.monotonic() + 30
    while (ffmpeg := encoder_of(w)) is None:
        assert time.monotonic() < deadline, "no encoder started"
        time.sleep(0.02)
    return ffmpeg


def test_a_big_encode_runs_niced_and_yields_to_small_work(workers):
    w = workers.start("--cpu-slots", "1", "--encode-nice", "7")
    results: dict[str, Any] = {}
    big = saved_on_thread(w, big_clip(), "big.mp4", results, preset="placebo")
    ffmpeg = running_encoder(w)
    # (the suite's workers run "normal": tests/support/worker.py)
    assert priority_of_threads(ffmpeg) == {(7, "normal")}, "every thread, x264's included"
    assert priority_of_threads(w.pid) == {(0, "normal")}  # the worker: its loop goes first
    big.join(timeout=120)
    assert results["big.mp4"]["ok"]


def test_without_the_lane_a_tiny_encode_waits_for_the_slot(workers):
    w = workers.start("--cpu-slots", "1", "--small-encode-bytes", "0")
    _, tinies, big, _ = under_a_big_encode(w, 1)
    assert tinies[0]["timings"]["started_at"] >= big["timings"]["finished_at"] - 0.01
    assert tinies[0]["timings"]["queue_ms"] > 100


def test_tiny_outputs_of_one_request_share_the_lane_one_at_a_time(workers):
    w = workers.start("--cpu-slots", "1")
    results: dict[str, Any] = {}
    big = saved_on_thread(w, big_clip(), "big.mp4", results, preset="placebo")
    wait_for(w, RUNNING, 1)
    with Client(w.uds_url) as c:
        a, b = c.save_videos([make_clip(**TINY, seed=1), make_clip(**TINY, seed=2)],
                             ["a.mp4", "b.mp4"], fps=24, threads=1)  # fmt: skip
    big.join(timeout=120)
    ta, tb = a.timings, b.timings
    assert min(ta.finished_at, tb.finished_at) <= max(ta.started_at, tb.started_at)  # in turn
    assert max(ta.finished_at, tb.finished_at) < results["big.mp4"]["timings"]["finished_at"]


def test_the_lane_judges_the_whole_work_not_the_frames_alone(workers):
    """Tiny frames with seconds of audio, or with the vllm-omni profile's own PyAV child,
    are not small work: they wait for the slot; a bare thumbnail still takes the lane."""
    w = workers.start("--cpu-slots", "1")
    results: dict[str, Any] = {}
    big = saved_on_thread(w, big_clip(), "big.mp4", results, preset="placebo")
    wait_for(w, RUNNING, 1)
    voiced = saved_on_thread(w, make_clip(**TINY, seed=1), "voiced.mp4", results,
                             profile="sglang", audio=waveform(24000 * 5, 1),
                             audio_sample_rate=24000)  # fmt: skip
    omni = saved_on_thread(w, make_clip(**TINY, seed=2), "omni.mp4", results,
                           profile="vllm-omni")  # fmt: skip
    wait_for(w, WAITING, 2)  # both wait for the slot (in the lane they would have run)
    with Client(w.uds_url) as c:
        thumb = c.save_video(make_clip(**TINY, seed=3), "thumb.mp4", fps=24, threads=1)
    for t in (big, voiced, omni):
        t.join(timeout=120)
    done = results["big.mp4"]["timings"]["finished_at"]
    assert thumb.ok and thumb.timings.finished_at < done, (thumb.timings, done)
    for name in ("voiced.mp4", "omni.mp4"):
        r = results[name]
        assert r["ok"] and r["timings"]["started_at"] >= done - 0.01, (name, r["timings"], done)
