"""Fairness: with more encodes than CPU slots, they start in the order they arrived, each
as soon as the one before it lets go of the slot."""

from __future__ import annotations

from typing import Any

from tests.support.media import make_clip
from tests.support.requests import RUNNING, WAITING, saved_on_thread, wait_for

SLACK_S = 0.5  # a loaded 2-core host: the thread hop, the probe, the next ffmpeg's start


def test_waiting_encodes_start_in_arrival_order_each_on_its_turn(workers):
    w = workers.start("--cpu-slots", "1")
    results: dict[str, Any] = {}
    # The slot is taken first; then four encodes arrive one after another, each one
    # seen waiting before the next is sent: the arrival order is known.
    first = make_clip(frames=48, height=256, width=256)
    threads = [saved_on_thread(w, first, "first.mp4", results, preset="placebo")]
    wait_for(w, RUNNING, 1)
    order = [f"rank{i}.mp4" for i in range(4)]
    for i, name in enumerate(order):
        clip = make_clip(frames=24, height=240, width=320, seed=i + 1)
        threads.append(saved_on_thread(w, clip, name, results))
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
