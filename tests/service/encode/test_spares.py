"""The vllm-omni profile's PyAV writers started ahead: an encode takes one that has its
imports done, it never shares a process with another encode (x264's state with it), its
bytes are those of a writer started afresh, and none outlives the worker."""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import av
import pytest
from framewire.client import Client, pyav_identity
from framewire.service._encode.spares import REFILL_AFTER_S

from tests.support.engines import vllm_omni_quantize, vllm_omni_save
from tests.support.media import make_clip
from tests.support.worker import Worker

ENCODER = pyav_identity(av.__version__)
T = TypeVar("T")


def spares(w: Worker) -> list[int]:
    """The worker's PyAV writers started ahead (waiting for a job, or running the one they
    took)."""
    found = []
    for pid in w.children():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--spare" in argv:
            found.append(pid)
    return found


def until(ready: Callable[[], T], timeout: float, failed: str) -> T:
    """What ``ready()`` returns once it is true, looked at every 10 ms for at most
    ``timeout`` seconds (else ``failed``)."""
    deadline = time.monotonic() + timeout
    while not (value := ready()):
        assert time.monotonic() < deadline, failed
        time.sleep(0.01)
    return value


def wait_for_spare(w: Worker, other_than: set[int]) -> int:
    """The writer started ahead, not one of ``other_than``."""
    ready = until(
        lambda: [p for p in spares(w) if p not in other_than], 30, "no writer was started ahead"
    )
    [pid] = ready
    return pid


def write(c: Client, name: str, clip, **kw) -> object:
    with c.open_video(name, fps=24, profile="vllm-omni", encoder=ENCODER, **kw) as writer:
        writer.write(clip)
    return writer.result


def test_an_encode_takes_the_writer_started_ahead_and_another_is_started(workers, tmp_path):
    """medium with threads 0: in one long-lived process PyAV's x264 would not give the same
    bytes twice; each encode's writer is a process of its own, each the bytes of a writer
    started afresh (vLLM-omni's own encode of the frames, in this process's first run).
    The next writer is started once the encode has ended, not beside it."""
    w = workers.start("--pyav-spares", "1", yielding=True)
    clip = make_clip(frames=10, height=96, width=128) * 2 - 1
    kw = {"preset": "medium", "threads": 0}
    with Client(w.uds_url, local_fallback=False) as c:
        first = write(c, "a.mp4", clip, **kw)  # no writer ahead yet: one started for it
        spare = wait_for_spare(w, set())
        writer = c.open_video("b.mp4", fps=24, profile="vllm-omni", encoder=ENCODER, **kw)
        writer.write(clip)
        writer.flush()  # read by the encoder: it runs
        # The one started ahead took it, at an encode's priority; none starts beside it.
        assert Path(f"/proc/{spare}/autogroup").read_text().split()[-1] == "19"
        time.sleep(0.5)
        assert spares(w) == [spare]
        second = writer.close()
        following = wait_for_spare(w, {spare})  # once it ended
        third = write(c, "c.mp4", clip, **kw)
    want = vllm_omni_save(vllm_omni_quantize(clip, (-1.0, 1.0)), tmp_path / "v.mp4", fps=24,
                          options={"preset": "medium", "threads": "0"})  # fmt: skip
    assert first.sha256 == second.sha256 == third.sha256 == want
    assert following != spare and not Path(f"/proc/{spare}").exists()
    last = wait_for_spare(w, {spare, following})
    w.stop()  # the writers still waiting go with the worker
    assert not Path(f"/proc/{last}").exists()


def test_a_writer_started_ahead_writes_a_memory_output_into_its_memfd(workers, tmp_path):
    """The job names the memfd itself (``/proc/self/fd/N``, no file name after it): the
    writer gets it under another number and writes the engine's bytes into it."""
    w = workers.start("--pyav-spares", "1", yielding=True)
    clip = make_clip(frames=4, height=48, width=64) * 2 - 1
    with Client(w.uds_url, local_fallback=False) as c:
        write(c, "warm.mp4", clip)
        spare = wait_for_spare(w, set())
        result = write(c, "memory://m.mp4", clip)
    until(lambda: spare not in spares(w), 10, "the writer started ahead did not take the job")
    want = vllm_omni_save(vllm_omni_quantize(clip, (-1.0, 1.0)), tmp_path / "v.mp4", fps=24)
    assert result.data is not None and hashlib.sha256(result.data).hexdigest() == want


@pytest.mark.parametrize("count", ["0", "1", None])
def test_the_writers_started_ahead_are_a_setting(workers, count):
    """Two by default: encodes back to back (the next begins before the refill 0.25 s
    after the last one's end) take the second, where with one every other one started
    its own on its path (benchmarks/back_to_back.py, 33-frame saves back to back: 0.255
    s a save with one, 0.236 with two, 0.307 with none)."""
    w = workers.start(*([] if count is None else ["--pyav-spares", count]))
    count = count or "2"
    clip = make_clip(frames=4, height=48, width=64)
    with Client(w.uds_url, local_fallback=False) as c:
        write(c, "a.mp4", clip)
        until(lambda: len(spares(w)) >= int(count), 10, f"fewer than {count} started ahead")
        time.sleep(REFILL_AFTER_S + 0.25)  # and no more than that
        assert len(spares(w)) == int(count)


def test_the_next_writer_is_started_once_the_output_is_handed_over(monkeypatch):
    """Not when the encode's writer ends: its output's hand-over (the worker's answer,
    the caller's take) comes then, and the start of an interpreter beside it slows it."""
    from framewire.core.media.priority import FULL
    from framewire.service._encode import spares as module

    monkeypatch.setattr(module, "REFILL_AFTER_S", 1.0)
    waiting = [
        sys.executable,
        "-c",
        "import socket, sys; socket.socket(fileno=int(sys.argv[2])).recv(1)",
    ]
    ahead = module.Spares(waiting, 1)
    try:
        writer = ahead.start([], [], None, FULL)  # none ahead yet: started afresh
        writer.close()
        ended = time.monotonic()
        time.sleep(0.3)
        assert ahead._ready == []  # not yet
        until(lambda: ahead._ready, ended + 10 - time.monotonic(), "no writer was started ahead")
        assert time.monotonic() - ended >= 1.0
    finally:
        ahead.close()


def test_refills_at_once_start_no_more_writers_than_the_count(monkeypatch):
    """Two encodes that end together each refill: the second counts the writers the
    first is starting, and the count is what waits (each one's memory: 34 MiB)."""
    from framewire.service._encode import spares as module

    started: list[object] = []

    class Slow:
        def __init__(self, child: list[str]):
            time.sleep(0.2)  # a start takes a while: the two refills overlap
            started.append(self)

        def discard(self) -> None:
            pass

    monkeypatch.setattr(module, "Spare", Slow)
    ahead = module.Spares(["unused"], 2)
    refills = [threading.Thread(target=ahead._refill) for _ in range(2)]
    for refill in refills:
        refill.start()
    for refill in refills:
        refill.join(10)
    assert len(started) == 2 and len(ahead._ready) == 2


def test_a_writer_that_died_waiting_is_let_go_and_the_encode_starts_its_own(workers):
    """(Dead before it is taken: one that dies as it takes its job fails that encode, as a
    child started afresh that dies does.)"""
    w = workers.start("--pyav-spares", "1")
    clip = make_clip(frames=6, height=48, width=64)
    with Client(w.uds_url, local_fallback=False) as c:
        first = write(c, "a.mp4", clip)
        dead = wait_for_spare(w, set())
        os.kill(dead, signal.SIGKILL)

        def zombie() -> bool:
            return Path(f"/proc/{dead}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"

        until(zombie, 10, "the writer did not die")
        again = write(c, "b.mp4", clip)
        wait_for_spare(w, {dead})
    assert again.sha256 == first.sha256
    assert dead not in w.children()  # reaped


def group_nice_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])


def test_a_writer_waits_yielding_and_an_encode_at_full_weight_takes_its_group_back(workers):
    """A writer's start (an interpreter and PyAV's import, about 0.1 CPU-s after every
    encode) and its wait weigh as an encode's: its session at niceness 19. An encode that
    does not yield (this worker's: the suite's do not) gives the one it takes the
    worker's weight back."""
    w = workers.start("--pyav-spares", "1")
    clip = make_clip(frames=6, height=48, width=64)
    with Client(w.uds_url, local_fallback=False) as c:
        write(c, "a.mp4", clip)
        spare = wait_for_spare(w, set())
        # Set by the worker right after the spawn: the writer is seen a moment before.
        until(lambda: group_nice_of(spare) == 19, 3, "the waiting writer's group is not at 19")
        writer = c.open_video("b.mp4", fps=24, profile="vllm-omni", encoder=ENCODER)
        writer.write(clip)
        writer.flush()  # the encoder took it: the spare runs the encode
        assert spares(w) == [spare]
        # Within 3 s: a write the kernel refused is retried.
        until(lambda: group_nice_of(spare) == 0, 3, "the encode kept the waiting writer's weight")
        writer.close()
