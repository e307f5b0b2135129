"""A session whose first chunk waits for CPU slots behind another session can be ended.

With one CPU slot, session A holds it from its first chunk; session B's first
chunk waits. Every way of ending B (DELETE, the idle reaper, its producer going
away, ``VideoWriter.abort``) must end it at once and leave nothing, while A goes
on to a byte-exact file.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from framewire.client import AsyncClient, Client

from tests.service.stream.test_sessions import open_stream, send_frames
from tests.support.media import make_clip, reference_mp4, sha256
from tests.support.requests import Baseline, Request, raw_http, settle
from tests.support.segments import Segments
from tests.support.worker import Worker, metric

ENDED_WITHIN_S = 5.0


def wait_until(condition: Any, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def waiting(h: Any) -> float:
    return metric(h, "framewire_encodes_waiting")


def queued(h: Any, answered: Any = lambda: False) -> float:
    """Give a chunk just sent time to reach the admission queue (it must not have been
    answered: the slot is taken); how many wait there by the metrics."""
    time.sleep(1.0)
    assert not answered(), "the chunk was answered: it did not wait for the slot"
    return waiting(h)


def state(h: Any, sid: str) -> str:
    return h.get(f"/v1/streams/{sid}").json()["state"]


@contextmanager
def holder(w: Worker, segments: Segments, clip: torch.Tensor, tmp_path: Path) -> Iterator[Any]:
    """Session A: it holds the only CPU slot, sending a frame every 0.2 s (never idle)
    until the block ends; then it finishes and must give the reference's bytes."""
    stop = threading.Event()
    with w.http() as h:
        sid = open_stream(h, clip, path="holder.mp4")
        assert send_frames(h, segments, sid, clip, 0, 1).status_code == 200

        def keep_sending() -> None:
            with w.http() as h2:
                for t in range(1, clip.shape[1] - 1):
                    if stop.wait(0.2):
                        return
                    assert send_frames(h2, segments, sid, clip, t, t + 1).status_code == 200
                stop.wait()

        sender = threading.Thread(target=keep_sending, daemon=True)
        sender.start()
        try:
            yield h
        finally:
            stop.set()
            sender.join(30)
        received = h.get(f"/v1/streams/{sid}").json()["frames_received"]
        assert send_frames(h, segments, sid, clip, received, clip.shape[1]).status_code == 200
        r = h.post(f"/v1/streams/{sid}/finish")
        assert r.status_code == 200, r.text
    assert sha256(w.outputs / "holder.mp4") == reference_mp4(clip, tmp_path / "ref.mp4")


def second_session(h: Any, segments: Segments, clip: torch.Tensor, path: str) -> tuple[str, Any]:
    """Session B, opened, and its first chunk (to be sent: it waits for A's slot)."""
    sid = open_stream(h, clip, path=path)
    return sid, {"first_frame": 0, "source": segments.source(clip[:, :2].contiguous())}


@pytest.fixture
def one_slot(workers) -> Worker:
    return workers.start("--cpu-slots", "1", "--stream-idle-s", "2")


def test_delete_ends_a_session_waiting_for_admission(one_slot, segments, tmp_path):
    w = one_slot
    baseline = Baseline.of(w)
    clip = make_clip(frames=60, height=48, width=64)
    with holder(w, segments, clip, tmp_path) as h:
        sid, chunk = second_session(h, segments, clip, "waiter/b.mp4")
        pending = Request(w, "POST", f"/v1/streams/{sid}/frames", json=chunk)
        in_queue = queued(h, lambda: not pending.is_alive())
        started = time.monotonic()
        assert h.delete(f"/v1/streams/{sid}", timeout=ENDED_WITHIN_S).status_code == 204
        answer = pending.result(timeout=ENDED_WITHIN_S)
        assert time.monotonic() - started < ENDED_WITHIN_S
        assert (answer.status_code, answer.json()["code"]) == (499, "cancelled")
        assert state(h, sid) == "aborted"
        assert (in_queue, waiting(h)) == (1, 0)  # counted while it waited
        assert metric(h, 'framewire_stream_aborts_total{cause="deleted"}') == 1
    assert not (w.outputs / "waiter").exists()
    settle(w, baseline, keep=set(segments.keys))


def test_the_reaper_ends_a_session_waiting_for_admission(one_slot, segments, tmp_path):
    w = one_slot
    clip = make_clip(frames=60, height=48, width=64)
    with holder(w, segments, clip, tmp_path) as h:
        sid, chunk = second_session(h, segments, clip, "waiter.mp4")
        pending = Request(w, "POST", f"/v1/streams/{sid}/frames", json=chunk)
        # The idle timeout is 2 s: the waiting chunk is answered within a few seconds.
        answer = pending.result(timeout=2 + ENDED_WITHIN_S)
        assert (answer.status_code, answer.json()["code"]) == (499, "cancelled")
        assert state(h, sid) == "aborted"
        assert metric(h, 'framewire_stream_aborts_total{cause="idle"}') == 1
    assert not (w.outputs / "waiter.mp4").exists()


def test_a_producer_gone_while_waiting_ends_the_session(one_slot, segments, tmp_path):
    w = one_slot
    clip = make_clip(frames=60, height=48, width=64)
    with holder(w, segments, clip, tmp_path) as h:
        sid, chunk = second_session(h, segments, clip, "gone.mp4")
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(w.uds))
            sock.sendall(raw_http("POST", f"/v1/streams/{sid}/frames", chunk))
            in_queue = queued(h)
        # The producer went away; its session ends well before the idle timeout's reach.
        wait_until(lambda: state(h, sid) == "aborted", "B was not aborted", ENDED_WITHIN_S)
        assert metric(h, 'framewire_stream_aborts_total{cause="client"}') == 1
        assert (in_queue, waiting(h)) == (1, 0)
    assert not (w.outputs / "gone.mp4").exists()


@pytest.fixture
def patient(workers) -> Worker:
    """One CPU slot and a long idle timeout: only the writer's abort may end session B."""
    return workers.start("--cpu-slots", "1", "--stream-idle-s", "60")


def test_video_writer_abort_does_not_wait_for_the_slot(patient, segments, tmp_path):
    w = patient
    clip = make_clip(frames=60, height=48, width=64)
    with holder(w, segments, clip, tmp_path) as h, Client(w.uds_url) as c:
        writer = c.open_video("written.mp4", fps=24)
        writer.write(clip[:, :2])  # returns at once; its request waits for the slot
        in_queue = queued(h)
        aborting = threading.Thread(target=writer.abort, daemon=True)
        aborting.start()
        aborting.join(ENDED_WITHIN_S)
        assert not aborting.is_alive(), "VideoWriter.abort() waited for the other session"
        assert metric(h, 'framewire_stream_aborts_total{cause="deleted"}') == 1
        assert (in_queue, waiting(h)) == (1, 0)
    assert not (w.outputs / "written.mp4").exists()


def test_async_video_writer_abort_does_not_wait_for_the_slot(patient, segments, tmp_path):
    w = patient
    clip = make_clip(frames=60, height=48, width=64)

    async def write_then_abort() -> None:
        async with AsyncClient(w.uds_url) as c:
            writer = c.open_video("written-async.mp4", fps=24)
            await writer.write(clip[:, :2])  # returns at once; its request waits for the slot
            await asyncio.sleep(1.0)
            started = time.monotonic()
            # Bounded, and the bound's cancellation must not be swallowed by abort().
            await asyncio.wait_for(writer.abort(), ENDED_WITHIN_S)
            assert time.monotonic() - started < ENDED_WITHIN_S

    with holder(w, segments, clip, tmp_path) as h:
        asyncio.run(write_then_abort())
        assert metric(h, 'framewire_stream_aborts_total{cause="deleted"}') == 1
        assert waiting(h) == 0
    assert not (w.outputs / "written-async.mp4").exists()
