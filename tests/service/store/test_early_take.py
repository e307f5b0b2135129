"""A stream session's memory output taken before the worker's answer: its ticket is
reserved when the session opens (and named in the answer), the output held under it as
soon as its file is whole, before its hash and checks; a take waiting on it answers then.
A reservation counts as held, another's is not waited for, and one whose output fails
or whose session ends lets its waiters go."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading

import pytest
from framewire.client import Client
from framewire.core.errors import NotFound, Overloaded
from framewire.service._store.handoff import Handoffs, MemoryTarget
from framewire.service._store.memfile import MemoryHold

from tests.support.media import make_clip
from tests.support.processes import open_memfds

ME = os.getuid()
STRANGER = 4242 if ME != 4242 else 4243  # neither root nor the worker's own uid


def _written(handoffs: Handoffs, target: MemoryTarget, data: bytes) -> MemoryHold:
    hold = MemoryHold(target, handoffs)
    destination = hold.destination()
    assert destination is not None
    os.pwrite(destination.fd, data, 0)
    return hold


def test_a_take_waits_for_the_file_not_for_its_hash_and_checks():
    """The take answers while the checks still run (they wait for it to have answered)."""
    handoffs = Handoffs()
    target = MemoryTarget("a.mp4", uid=ME)
    ticket = handoffs.reserve(target)
    data = os.urandom(300_000)
    hold = _written(handoffs, MemoryTarget("a.mp4", uid=ME, ticket=ticket), data)
    taken = threading.Event()
    checked: list[bool] = []

    def inspect(path: str) -> None:
        checked.append(taken.wait(10))  # still checking until the take has answered

    async def take() -> bytes:
        fd, size = await handoffs.take_when_held(ticket, ME, 10)
        try:
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)
            taken.set()

    async def both() -> tuple[bytes, tuple[int, str]]:
        temp = hold.destination()
        assert temp is not None
        encoding = asyncio.to_thread(temp.digest_inspected, inspect, hold)
        got, digest = await asyncio.gather(take(), encoding)
        return got, digest

    try:
        got, (size, sha256) = asyncio.run(both())
        assert checked == [True]
        assert got == data and size == len(data) and sha256 == hashlib.sha256(data).hexdigest()
        assert hold.handed() == ticket  # the result names the ticket it is held under
    finally:
        hold.close()
        handoffs.close()


def test_an_output_that_fails_once_held_is_let_go():
    handoffs = Handoffs()
    before = open_memfds("framewire-output:")
    ticket = handoffs.reserve(MemoryTarget("a.mp4", uid=ME))
    hold = _written(handoffs, MemoryTarget("a.mp4", uid=ME, ticket=ticket), b"x" * 5000)
    temp = hold.destination()
    assert temp is not None
    hold.written(temp)
    assert handoffs.held() == 1
    hold.close()  # its checks failed: not handed to a result
    assert handoffs.held() == 0 and open_memfds("framewire-output:") == before
    with pytest.raises(NotFound):
        handoffs.take(ticket, ME)
    handoffs.close()


def test_a_reservation_counts_and_its_waiters_go_when_it_is_let_go():
    handoffs = Handoffs(max_held=2)
    tickets = [handoffs.reserve(MemoryTarget(f"{i}.mp4", uid=ME)) for i in range(2)]
    with pytest.raises(Overloaded) as full:
        handoffs.reserve(MemoryTarget("c.mp4", uid=ME))
    assert full.value.code == "handoffs_full"

    async def waits() -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        waiting = asyncio.ensure_future(handoffs.take_when_held(tickets[0], ME, 10))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        handoffs.cancel(tickets[0])  # its session ended with nothing held
        with pytest.raises(NotFound):
            await waiting
        return loop.time() - started

    assert asyncio.run(waits()) < 5
    handoffs.reserve(MemoryTarget("d.mp4", uid=ME))  # the slot is free again

    async def strangers() -> None:  # another's reservation answers at once, as unknown
        with pytest.raises(NotFound):
            await asyncio.wait_for(handoffs.take_when_held(tickets[1], STRANGER, 10), 2)
        with pytest.raises(NotFound):  # the wait is bounded
            await asyncio.wait_for(handoffs.take_when_held(tickets[1], ME, 0.1), 2)
        with pytest.raises(TimeoutError):  # and a take given up stops waiting
            await asyncio.wait_for(handoffs.take_when_held(tickets[1], ME, 10), 0.1)
        # Neither left a waiter on the reservation (a take asked every second would
        # add one each time).
        assert handoffs._reserved[tickets[1]].waiters == []

    asyncio.run(strangers())
    handoffs.close()


def test_a_sessions_bytes_are_taken_before_the_answer(worker, monkeypatch):
    """The opening names the ticket; the client takes the bytes under it before it reads
    the finish's answer, and checks them against that answer's sha256."""
    from framewire.client import _session

    order: list[str] = []
    own_take, own_data = _session.take_hashed, _session.WriterBase._take_data

    def take(*args, **kw):
        got = own_take(*args, **kw)
        order.append("taken")
        return got

    def data(self, result, early=None):
        order.append("answered" if early is not None else "answered without the bytes")
        return own_data(self, result, early)

    monkeypatch.setattr(_session, "take_hashed", take)
    monkeypatch.setattr(_session.WriterBase, "_take_data", data)
    clip = make_clip(frames=6, height=48, width=64, seed=8)
    with Client(worker.uds_url, fd_socket=worker.fd_socket) as fw:
        with fw.open_video("memory://m.mp4", fps=24) as writer:
            writer.write(clip)
        with fw.open_video(worker.outputs / "f.mp4", fps=24) as on_disk:
            on_disk.write(clip)
    # A file output has no ticket: nothing taken, early or late.
    assert order == ["taken", "answered", "answered without the bytes"]
    assert writer.result is not None and writer.result.data is not None
    assert hashlib.sha256(writer.result.data).hexdigest() == writer.result.sha256
    assert (
        writer.result.sha256 == hashlib.sha256((worker.outputs / "f.mp4").read_bytes()).hexdigest()
    )


def test_an_early_take_is_given_up_once_the_finish_answered(monkeypatch):
    """A finish that failed, or never reached the worker, leaves the session holding its
    ticket: the take is asked again a second at a time only while the finish is on its
    way, and never past the client's own bound."""
    import time
    from types import SimpleNamespace

    from framewire.client import _session

    asked: list[float] = []

    def not_held(ticket, path, wait_s, *, worker_uid=None):
        asked.append(wait_s)
        time.sleep(min(wait_s, 5.0))  # the worker waits that long for the file
        raise NotFound("no output is held under that ticket", code="handoff_not_found")

    monkeypatch.setattr(_session, "take_hashed", not_held)
    regions = SimpleNamespace(path="/nowhere", timeout=60.0, worker_uid=None)
    writer = SimpleNamespace(_handoff="ab" * 16, _regions=regions)
    answer_at = time.monotonic() + 0.3
    started = time.monotonic()
    got = _session.WriterBase._take_early(writer, lambda: time.monotonic() > answer_at)
    assert got is None and 0.25 < time.monotonic() - started < 2
    assert asked and all(w <= _session.EARLY_WAIT_S for w in asked)
    regions.timeout = 0.2  # the client's bound, the finish never answering
    started = time.monotonic()
    assert _session.WriterBase._take_early(writer, lambda: False) is None
    assert time.monotonic() - started < 1
