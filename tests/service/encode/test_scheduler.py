"""Admission control: slots, FIFO, the bounded queue, cancellation; unit and end to end."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import select
import socket
import threading
import time

import pytest
import torch
from framewire.client import Client, Overloaded
from framewire.core.errors import Overloaded as OverloadedError
from framewire.service._encode.scheduler import Scheduler

from tests.support.identity import NOBODY, as_nobody
from tests.support.media import make_clip, reference_mp4
from tests.support.real import needs_root
from tests.support.requests import RUNNING, WAITING, post_raw, raw_http, wait_for

# ----------------------------------------------------------------------------- unit


def test_slots_fifo_and_release():
    async def go() -> list[str]:
        s = Scheduler(cpu_slots=4, max_queue=10)
        order: list[str] = []

        async def encode(name: str, cpu: int, seconds: float) -> None:
            async with s.hold(cpu):
                order.append(f"start {name}")
                await asyncio.sleep(seconds)
            order.append(f"end {name}")

        await asyncio.gather(
            encode("a", 3, 0.05),
            encode("b", 3, 0.01),  # waits for a
            encode("c", 1, 0.01),  # fits beside a, but b is first in line: FIFO
        )
        assert (s.cpu_used, s.running, s.waiting) == (0, 0, 0)
        return order

    order = asyncio.run(go())
    assert order.index("start b") > order.index("end a")
    assert order.index("start c") > order.index("start b")


def test_gpu_bytes_are_admitted_per_device():
    """A device's budget holds back encodes of its own frames only, in FIFO order, and an
    encode on a device that holds nothing of ours always starts."""
    free = {0: 100, 1: 1000}  # what a quarter of each device's free memory allows

    async def go() -> list[str]:
        s = Scheduler(cpu_slots=16, max_queue=10, gpu_budget=lambda d: free[d] + s.gpu_held(d))
        order: list[str] = []
        release = {name: asyncio.Event() for name in "abcde"}

        async def encode(name: str, gpu: int, device: int) -> None:
            async with s.hold(1, gpu, device):
                order.append(f"start {name}")
                await release[name].wait()
            order.append(f"end {name}")

        tasks = [
            asyncio.create_task(encode("a", 80, 0)),  # device 0 holds nothing: starts
            asyncio.create_task(encode("b", 300, 1)),  # another device: starts beside a
            asyncio.create_task(encode("c", 80, 0)),  # 80 + 80 > 100 + 80? no: fits
            asyncio.create_task(encode("d", 200, 0)),  # 160 + 200 > 100 + 160: waits
            asyncio.create_task(encode("e", 10, 1)),  # fits on device 1, but d is first: FIFO
        ]
        await asyncio.sleep(0.05)
        assert s.gpu_used == {0: 160, 1: 300} and s.waiting == 2
        free[0] = 10_000  # device 0's memory was freed by someone else meanwhile
        release["a"].set()  # any release re-reads the budgets: d, then e, start
        await asyncio.sleep(0.05)
        assert s.gpu_used == {0: 280, 1: 310} and s.waiting == 0
        for name in "bcde":
            release[name].set()
        await asyncio.gather(*tasks)
        assert s.gpu_used == {} and s.running == 0
        return order

    order = asyncio.run(go())
    assert order[:3] == ["start a", "start b", "start c"]
    assert order[3:6] == ["end a", "start d", "start e"]


def test_threads_are_capped_at_the_slot_count():
    async def go() -> None:
        s = Scheduler(cpu_slots=2, max_queue=0)
        async with s.hold(24):
            assert s.cpu_used == 2

    asyncio.run(go())


def test_full_queue_is_refused_with_retry_after():
    async def go() -> None:
        s = Scheduler(cpu_slots=1, max_queue=1)
        first = s.admit(1)  # idle: starts at once
        async with s.hold(1, admission=first):
            second = s.admit(1)  # one place in the queue
            waiter = asyncio.create_task(s.hold(1, admission=second).__aenter__())
            await asyncio.sleep(0)
            assert s.waiting == 1
            with pytest.raises(OverloadedError) as err:
                s.admit(1)
            assert err.value.code == "queue_full" and err.value.retry_after >= 1
            waiter.cancel()
            await asyncio.gather(waiter, return_exceptions=True)
        assert (s.waiting, s.cpu_used) == (0, 0)

    asyncio.run(go())


def test_admitted_encodes_count_until_they_start_and_a_caller_has_its_share():
    async def go() -> None:
        s = Scheduler(cpu_slots=1, max_queue=4, user_limit=2)
        async with s.hold(1):  # the slot is taken: whatever is admitted now waits
            theirs = [s.admit(1, user=1000), s.admit(1, user=1000)]
            with pytest.raises(OverloadedError) as err:
                s.admit(1, user=1000)
            assert err.value.code == "user_share" and err.value.retry_after >= 1
            ranks = s.admit(2)  # not limited: the places left are theirs
            with pytest.raises(OverloadedError) as err:
                s.admit(1)  # not yet in the queue, but counted as waiting
            assert err.value.code == "queue_full" and "4 encodes already wait" in str(err.value)
            waiter = asyncio.create_task(s.hold(1, admission=theirs[0]).__aenter__())
            await asyncio.sleep(0)
            assert s.waiting == 1  # in the queue now, and counted once
            with pytest.raises(OverloadedError):
                s.admit(1)
            waiter.cancel()
            await asyncio.gather(waiter, return_exceptions=True)
            for admission in [*theirs, ranks]:
                admission.close()
            s.admit(2, user=1000).close()  # everything let go: its share is whole again
        assert s._pending == {False: 0, True: 0} and s.share.held(1000) == 0 and s.cpu_used == 0

    asyncio.run(go())


def test_cancelled_waiter_leaves_the_queue_and_the_next_one_starts():
    async def go() -> None:
        s = Scheduler(cpu_slots=1, max_queue=5)
        started = asyncio.Event()

        async def holder() -> None:
            async with s.hold(1):
                started.set()
                await asyncio.sleep(0.05)

        async def waiter() -> None:
            async with s.hold(1):
                await asyncio.sleep(1)

        h = asyncio.create_task(holder())
        await started.wait()
        w1 = asyncio.create_task(waiter())
        w2 = asyncio.create_task(waiter())
        await asyncio.sleep(0.01)
        w1.cancel()
        await asyncio.gather(w1, return_exceptions=True)
        await h
        await asyncio.sleep(0.01)
        assert s.running == 1  # w2 took the slot w1 gave up
        w2.cancel()
        await asyncio.gather(w2, return_exceptions=True)
        assert (s.running, s.cpu_used, s.waiting) == (0, 0, 0)

    asyncio.run(go())


# ----------------------------------------------------------------------------- end to end


def overlap(a: dict, b: dict) -> float:
    ta, tb = a["timings"], b["timings"]
    return min(ta["finished_at"], tb["finished_at"]) - max(ta["started_at"], tb["started_at"])


def clip(seed: int) -> torch.Tensor:
    return make_clip(frames=24, height=240, width=320, seed=seed)


def results_of(c: Client, clips, paths, **kw):
    return [r.model_dump() for r in c.save_videos(clips, paths, fps=24, threads=2, **kw)]


@pytest.fixture
def roomy(workers):
    return workers.start("--cpu-slots", "4")


def test_two_outputs_of_one_request_overlap_and_stay_exact(roomy, tmp_path):
    clips = [clip(1), clip(2)]
    with Client(roomy.uds_url) as c:
        a, b = results_of(c, clips, ["o/a.mp4", "o/b.mp4"], preset="medium")
    assert overlap(a, b) > 0, (a["timings"], b["timings"])
    for i, r in enumerate((a, b)):
        ref = reference_mp4(clips[i], tmp_path / f"r{i}.mp4", preset="medium", threads=2)
        assert r["sha256"] == ref
    assert [a["path"], b["path"]] == [str(roomy.outputs / "o" / n) for n in ("a.mp4", "b.mp4")]


def test_two_concurrent_requests_overlap(roomy):
    out: dict[str, dict] = {}
    both_ready = threading.Barrier(2, timeout=30)

    def one(name: str, seed: int) -> None:
        video = clip(seed)
        with Client(roomy.uds_url) as c:
            both_ready.wait()  # the two requests leave together, not one after the other
            out[name] = results_of(c, [video], [f"c/{name}.mp4"], preset="medium")[0]

    threads = [threading.Thread(target=one, args=(n, i)) for i, n in enumerate("xy")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlap(out["x"], out["y"]) > 0


def test_with_slots_for_one_they_serialize(workers):
    w = workers.start("--cpu-slots", "2")
    with Client(w.uds_url) as c:
        a, b = results_of(c, [clip(1), clip(2)], ["s/a.mp4", "s/b.mp4"], preset="medium")
    assert overlap(a, b) <= 0
    assert max(a["timings"]["queue_ms"], b["timings"]["queue_ms"]) > 0


def shm_body(key: str, t: torch.Tensor, path: str) -> dict:
    src = {"kind": "shm", "key": key, "byte_size": t.numel() * 4, "dtype": "float32",
           "shape": list(t.shape)}  # fmt: skip
    return {
        "outputs": [{"source": src, "path": path, "fps": 24, "preset": "placebo", "threads": 1}]
    }


def metric(w, name: str) -> float:
    with w.http() as h:
        for line in h.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def test_full_queue_429_and_cancel_frees_slots(workers, segments):
    w = workers.start("--cpu-slots", "1", "--max-queue", "1")
    long = make_clip(frames=96, height=256, width=256)
    key = segments.write(long)
    socks = []
    try:
        socks.append(post_raw(w.uds, shm_body(key, long, "q/a.mp4")))  # runs
        deadline = time.monotonic() + 10
        while metric(w, "framewire_encodes_in_flight") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        socks.append(post_raw(w.uds, shm_body(key, long, "q/b.mp4")))  # waits
        while metric(w, "framewire_encodes_waiting") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with Client(w.uds_url) as c, pytest.raises(Overloaded) as err:
            # Past the small lane's size (a tiny clip would not wait for the slot).
            c.save_video(make_clip(frames=2, height=256, width=256), "q/c.mp4", fps=24)
        assert err.value.code == "queue_full" and err.value.retry_after >= 1
        with w.http() as h:
            r = h.post("/v1/videos:encode", json=shm_body(key, long, "q/d.mp4"))
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        for s in socks:  # both clients go away: the runner stops, the waiter leaves
            s.close()
        deadline = time.monotonic() + 15
        while metric(w, "framewire_encodes_in_flight") or metric(w, "framewire_encodes_waiting"):
            assert time.monotonic() < deadline, "cancelled requests kept their slots"
            time.sleep(0.05)
        with Client(w.uds_url) as c:
            r = c.save_video(make_clip(frames=2), "q/e.mp4", fps=24)
        assert r.ok and r.timings.queue_ms < 1000
        assert not (w.outputs / "q" / "a.mp4").exists() and not (w.outputs / "q" / "b.mp4").exists()
    finally:
        for s in socks:
            s.close()


def answer(sock: socket.socket) -> tuple[int, dict]:
    """The HTTP response a socket of ``post_raw`` gets: (status, its JSON)."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, json.loads(response.read())


def test_the_queue_bound_holds_for_requests_admitted_at_once(workers, segments):
    """Requests that arrive together are counted as waiting from their admission on,
    while each still makes and opens its output directory: no more than the limit
    are let in to wait, and every refusal tells the truth about the queue."""
    w = workers.start("--cpu-slots", "1", "--max-queue", "4")
    long = make_clip(frames=96, height=256, width=256)
    runner = post_raw(w.uds, shm_body(segments.write(long), long, "r/a.mp4"))
    socks: list[socket.socket] = []
    try:
        wait_for(w, RUNNING, 1)
        short = make_clip(frames=2, height=256, width=256)  # past the small lane's size
        key = segments.write(short)
        # Each request makes a directory of its own before it reaches the queue.
        bodies = [shm_body(key, short, f"burst/{i}/o.mp4") for i in range(40)]
        socks = [post_raw(w.uds, body) for body in bodies]
        answered: dict[int, tuple[int, dict]] = {}
        deadline = time.monotonic() + 30
        while len(answered) + metric(w, WAITING) < len(socks):  # each refused, or waiting
            assert time.monotonic() < deadline, (len(answered), metric(w, WAITING))
            ready, _, _ = select.select([s for s in socks if s.fileno() not in answered], [],
                                        [], 0.1)  # fmt: skip
            for s in ready:
                answered[s.fileno()] = answer(s)
        waited = metric(w, WAITING)
        runner.close()  # the long encode stops: the admitted ones run
        for s in socks:
            if s.fileno() not in answered:
                answered[s.fileno()] = answer(s)
    finally:
        for s in [runner, *socks]:
            s.close()
    statuses = [status for status, _ in answered.values()]
    refusals = [body["error"] for status, body in answered.values() if status == 429]
    assert waited == 4 and statuses.count(200) == 4, (waited, statuses, refusals[:3])
    assert all(body["code"] == "queue_full" for s, body in answered.values() if s == 429)
    assert set(refusals) == {"4 encodes already wait (limit 4)"}, set(refusals)
    # The refused ones made nothing; the admitted ones wrote their outputs.
    burst = w.outputs / "burst"
    assert sorted(p.name for p in burst.iterdir()) == sorted(
        p.parent.name for p in burst.glob("*/o.mp4")
    )


def queue_over_tcp(url: str, bodies: list[dict], wait_s: float) -> list[tuple[int, str] | None]:
    """Send every encode at once over loopback TCP; the answers that come within
    ``wait_s`` (None: still waiting), then go away (the waiting ones are cancelled)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    socks = [socket.create_connection((host, int(port))) for _ in bodies]
    try:
        for s, body in zip(socks, bodies, strict=True):
            s.sendall(raw_http("POST", "/v1/videos:encode", body))
        answered: dict[int, tuple[int, str]] = {}
        deadline = time.monotonic() + wait_s
        while len(answered) < len(socks) and (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([s for s in socks if s.fileno() not in answered], [],
                                        [], left)  # fmt: skip
            for s in ready:
                status, body = answer(s)
                answered[s.fileno()] = (status, body.get("code", "ok"))
        return [answered.get(s.fileno()) for s in socks]
    finally:
        for s in socks:
            s.close()


@needs_root
def test_one_caller_waits_in_its_share_of_the_queue(workers, segments):
    """Another user may have FRAMEWIRE_USER_SHARE of the queue waiting, not all of it:
    the places left are the ranks'."""
    w = workers.start("--cpu-slots", "1", "--max-queue", "4",
                      "--allowed-uids", f"{os.getuid()},{NOBODY}")  # fmt: skip
    w.outputs.chmod(0o777)
    # Long enough to hold the slot past the answers looked for, on a loaded host too.
    long = make_clip(frames=192, height=256, width=256)
    runner = post_raw(w.uds, shm_body(segments.write(long), long, "r/a.mp4"))
    try:
        wait_for(w, RUNNING, 1)
        short = make_clip(frames=2, height=256, width=256)  # past the small lane's size
        key = segments.write(short)  # readable by every user
        bodies = [shm_body(key, short, f"n{i}.mp4") for i in range(3)]
        got = as_nobody(queue_over_tcp, w.tcp_url, bodies, 2.0)
        # Two of its encodes wait (half of 4 places); the third is refused at once.
        assert isinstance(got, list) and sorted(got, key=str) == [
            (429, "user_share"),
            None,
            None,
        ], got
    finally:
        runner.close()
