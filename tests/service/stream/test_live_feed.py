"""A live feed's viewers, in one event loop: the slow one is dropped with its reason,
the others and the history go on; the history stops at its bound."""

from __future__ import annotations

import asyncio
import json

import pytest
from framewire.client._errors import Conflict, Overloaded
from framewire.service._ops.metrics import Metrics
from framewire.service._stream import live
from framewire.service._stream.live import LiveFeed


def _sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_a_slow_viewer_is_dropped_and_the_others_go_on(monkeypatch):
    monkeypatch.setattr(live, "VIEWER_QUEUE_BYTES", 1000)
    metrics = Metrics()

    async def run() -> tuple[list[bytes], bytes, LiveFeed]:
        feed = LiveFeed("s", metrics, lambda: None)
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
            feed._publish(bytes([i]) * 300, 0)
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
    monkeypatch.setattr(live, "HISTORY_BYTES", 1000)
    monkeypatch.setattr(live, "VIEWERS_PER_STREAM", 2)

    async def run() -> None:
        feed = LiveFeed("s", Metrics(), lambda: None)
        first = feed.join()
        feed.join()
        with pytest.raises(Overloaded):
            feed.join()
        feed._publish(bytes(600), 0)
        feed._publish(bytes(600), 0)  # past the bound: the history is released
        assert feed.history is None
        feed.leave(first)
        with pytest.raises(Conflict, match="no longer kept"):
            feed.join()
        await feed.close("aborted")

    asyncio.run(run())
