"""Fairness: with more encodes than CPU slots, they start in the order they arrived, each
as soon as the one before it lets go of the slot."""

from __future__ import annotations

import threading
import time
from typing import Any

from framewire.client import Client

from tests.support.media import make_clip
from tests.support.worker import Worker, metric

WAITING, RUNNING = "framewire_encodes_waiting", "framewire_encodes_in_flight"
SLACK_S = 0.5  # a loaded 2-core host: the thread hop, the probe, the next ffmpeg's start


def wait_for(w: Worker, name: str, value: float, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    with w.http() as h:
        while metric(h, name) < value:
            assert time.monotonic() < deadline, f"{name} never reached {value}"
            time.sleep(0.01)


def in_thread(w: Worker, clip: Any, path: str, out: dict[str, Any], **kw: Any) -> threading.Thread:
    def run() -> None:
        with Client(w.uds_url) as c:
            out[path] = c.save_video(clip, path, fps=24, threads=1, **kw).model_dump()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_waiting_encodes_start_in_arrival_order_each_on_its_turn(workers):
    w = workers.start("--cpu-slots", "1")
    results: dict[str, Any] = {}
    # The slot is taken first; then four encodes arrive one after another, each one
    # seen waiting before the next is sent: the arrival order is known.
    threads = [in_thread(w, make_clip(frames=48, height=256, width=256), "first.mp4", results,
                         preset="placebo")]  # fmt: skip
    wait_for(w, RUNNING, 1)
    order = [f"rank{i}.mp4" for i in range(4)]
    for i, name in enumerate(order):
        clip = make_clip(frames=24, height=240, width=320, seed=i + 1)
        threads.append(in_thread(w, clip, name, results))
        wait_for(w, WAITING, i + 1)
    for t in threads:
        t.join(timeout=120)
    assert all(results[n]["ok"] for n in ["first.mp4", *order]), results

    timings = {n: results[n]["timings"] for n in ["first.mp4", *order]}
    started = sorted(order, key=lambda n: timings[n]["started_at"])
    assert started == order, {n: timings[n]["started_at"] for n in order}
    one_encode = max(t["finished_at"] - t["started_at"] for t in timings.values())
    before = "first.mp4"
    for position, name in enumerate(order, start=1):
        t, previous = timings[name], timings[before]
        # One slot: it starts once the one before it is done, and not long after.
        assert t["started_at"] >= previous["finished_at"] - 0.01, (name, timings)
        assert t["started_at"] - previous["finished_at"] <= SLACK_S, (name, timings)
        # No rank waits more than its place in line, in encodes, beyond its turn.
        assert t["queue_ms"] / 1e3 <= position * one_encode + SLACK_S, (name, timings)
        before = name
