"""The vllm-omni profile's PyAV writers forked from a template started ahead: each encode is
a process of its own forked from it (the template reused, never encoding itself), its
bytes those of a writer started afresh, its status, stall bound and priority the worker's
to know and set, and neither the template nor a writer outlives the worker."""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from framewire.client import Client
from framewire.core.errors import FramewireError
from framewire.service._encode.forks import START_AFTER_S

from tests.support.engines import vllm_omni_quantize, vllm_omni_save
from tests.support.media import make_clip
from tests.support.pyav_forks import (
    dead,
    group_nice_of,
    running_writer,
    settled,
    spare_of,
    steady_fds,
    templates,
    until,
    wait_for_template,
    write,
    writers_of,
)
from tests.support.worker import Worker


def test_each_encode_is_a_writer_forked_from_one_template(workers, tmp_path):
    """medium with threads 0: in one long-lived process PyAV's x264 would not give the same
    bytes twice; each encode's writer is forked from the template (which stays, and
    never encodes), a session of its own, the bytes of vLLM-omni's own encode (in this
    process's first run). The template is started once the first encode has ended."""
    w = workers.start(yielding=True)
    clip = make_clip(frames=10, height=96, width=128) * 2 - 1
    kw = {"preset": "medium", "threads": 0}
    with Client(w.uds_url, local_fallback=False) as c:
        assert templates(w) == []
        first = write(c, "a.mp4", clip, **kw)  # no template yet: its writer started afresh
        template = wait_for_template(w)
        writer, forked = running_writer(c, template, "b.mp4", clip, **kw)
        assert os.getsid(forked) == forked != os.getsid(template)
        # An encode's priority: its own group at 19 (the suite's workers yield).
        until(lambda: group_nice_of(forked) == 19, 3, "the writer's group is not at 19")
        second = writer.close()
        until(lambda: not Path(f"/proc/{forked}").exists(), 10, "the writer was not reaped")
        spare_of(template)
        fds = len(w.open_fds()), steady_fds(template)
        writer, again = running_writer(c, template, "c.mp4", clip, **kw)
        third = writer.close()
        assert templates(w) == [template]
        # Each writer's pipes, pidfd and sockets went with it, in the worker and the template
        # (which holds a spare's again).
        until(lambda: writers_of(template) == set(), 10, "the writer was not reaped")
        spare_of(template)
        assert (len(w.open_fds()), steady_fds(template)) == fds
    want = vllm_omni_save(vllm_omni_quantize(clip, (-1.0, 1.0)), tmp_path / "v.mp4", fps=24,
                          options={"preset": "medium", "threads": "0"})  # fmt: skip
    assert first.sha256 == second.sha256 == third.sha256 == want
    assert again != forked
    w.stop()  # the template goes with the worker
    assert not Path(f"/proc/{template}").exists()


def test_encodes_at_once_each_fork_a_writer_of_their_own(workers, tmp_path):
    """Jobs sent to the template one at a time, the writers running side by side: each
    encode's bytes its own (two clips, three encodes of each at once)."""
    w = workers.start("--cpu-slots", "6")
    clips = [make_clip(frames=8, height=48, width=64, seed=s) * 2 - 1 for s in (1, 2)]
    with Client(w.uds_url, local_fallback=False) as c:
        write(c, "warm.mp4", clips[0])
        template = wait_for_template(w)
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda i: write(c, f"{i}.mp4", clips[i % 2]).sha256, range(6)))
        assert templates(w) == [template]
    want = [
        vllm_omni_save(vllm_omni_quantize(clip, (-1.0, 1.0)), tmp_path / f"v{i}.mp4", fps=24)
        for i, clip in enumerate(clips)
    ]
    assert got == [want[i % 2] for i in range(6)] and want[0] != want[1]


def test_a_forked_writer_writes_a_memory_output_into_its_memfd(workers, tmp_path):
    """The job names the memfd itself (``/proc/self/fd/N``, no file name after it): the
    writer gets it under another number and writes the engine's bytes into it. The
    encode's CPU is its writer's (reaped by the template), none of it the template's."""
    w = workers.start(yielding=True)
    clip = make_clip(frames=24, height=240, width=320) * 2 - 1
    with Client(w.uds_url, local_fallback=False) as c:
        write(c, "warm.mp4", make_clip(frames=2, height=48, width=64))
        template = wait_for_template(w)
        own, reaped = settled(template)
        result = write(c, "memory://m.mp4", clip, preset="medium")
        own_after, reaped_after = settled(template)
    frames = vllm_omni_quantize(clip, (-1.0, 1.0))
    want = vllm_omni_save(frames, tmp_path / "v.mp4", fps=24, options={"preset": "medium"})
    assert result.data is not None and hashlib.sha256(result.data).hexdigest() == want
    # The template's own work over it (the job's answer, the writer reaped, the next
    # spare forked) takes a tick or two; on busy cores the 10 ms tick catches a fork's
    # more of them (past 2 once, beside two busy loops). An encode of its own: 10+.
    assert own_after - own <= 5, f"the template's own ticks rose {own_after - own}"
    assert reaped_after - reaped >= 10, f"its reaped writer's rose {reaped_after - reaped}"


@pytest.mark.parametrize("fork", [None, "--no-pyav-fork"])
def test_the_template_is_a_setting(workers, fork):
    """On by default: one template, whatever the encodes; off: every writer started
    afresh, the worker's child."""
    w = workers.start(*([] if fork is None else [fork]))
    clip = make_clip(frames=4, height=48, width=64)
    with Client(w.uds_url, local_fallback=False) as c:
        for name in ("a.mp4", "b.mp4", "c.mp4"):
            write(c, name, clip)
            time.sleep(START_AFTER_S + 0.25)
    assert len(templates(w)) == (1 if fork is None else 0)


def test_the_template_is_started_once_the_output_is_handed_over(monkeypatch):
    """Not when the first encode's writer ends: its output's hand-over (the worker's
    answer, the caller's take) comes then, and an interpreter's start beside it slows it."""
    from framewire.core.media.priority import FULL
    from framewire.service._encode import forks as module

    monkeypatch.setattr(module, "START_AFTER_S", 1.0)
    waiting = [
        sys.executable,
        "-c",
        "import socket, sys; socket.socket(fileno=int(sys.argv[1])).recv(1)",
    ]
    ahead = module.Forks(waiting, waiting)
    try:
        writer = ahead.start([], [], None, FULL)  # no template yet: started afresh
        writer.close()
        ended = time.monotonic()
        time.sleep(0.3)
        assert ahead._template is None  # not yet
        until(lambda: ahead._template, ended + 10 - time.monotonic(), "no template was started")
        assert time.monotonic() - ended >= 1.0
    finally:
        ahead.close()


def killed_mid_encode(
    c: Client, w: Worker, clip, victim: Callable[[int, int], int]
) -> tuple[object, int, int]:
    """A first encode, then one killed as it runs (``victim(template, writer)`` gets the
    SIGKILL), failed ``ffmpeg_killed``: (the first's result, the template, the writer)."""
    first = write(c, "a.mp4", clip)
    template = wait_for_template(w)
    writer, forked = running_writer(c, template, "b.mp4", clip)
    os.kill(victim(template, forked), signal.SIGKILL)
    # Dead before its input ends: a template's death (and its writer's with it) may else
    # come once this short encode has completed, under load.
    until(lambda: dead(forked), 10, "the writer outlived the kill")
    with pytest.raises(FramewireError) as failed:
        writer.close()
    assert failed.value.code == "ffmpeg_killed"
    return first, template, forked


def test_a_killed_writer_fails_its_encode_with_its_status_and_the_next_is_forked(workers):
    """Its status comes from the template (its parent): killed is ``ffmpeg_killed``."""
    w = workers.start()
    clip = make_clip(frames=6, height=48, width=64)
    with Client(w.uds_url, local_fallback=False) as c:
        first, template, _ = killed_mid_encode(c, w, clip, lambda template, writer: writer)
        again = write(c, "c.mp4", clip)
        assert templates(w) == [template]
    assert again.sha256 == first.sha256


def test_a_stopped_writer_is_killed_at_the_stall_bound(workers):
    """Its CPU time is read from /proc as a child's is; it is killed through its pidfd."""
    w = workers.start("--stall-timeout-s", "1")
    clip = make_clip(frames=6, height=48, width=64)
    with Client(w.uds_url, local_fallback=False) as c:
        write(c, "a.mp4", clip)
        template = wait_for_template(w)
        writer, forked = running_writer(c, template, "b.mp4", clip)
        os.kill(forked, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(FramewireError) as failed:
            writer.close()
        assert failed.value.code == "ffmpeg_stalled" and time.monotonic() - t0 < 10
        until(lambda: not Path(f"/proc/{forked}").exists(), 10, "the stopped writer lives on")
        write(c, "c.mp4", clip)


def test_a_dead_template_is_let_go_its_writers_with_it_and_another_started(workers):
    """Killed while a writer runs: that writer dies with it (the worker could not learn
    its status), its encode fails, the next starts its writer afresh, and after it a
    new template is started; the dead one is reaped."""
    w = workers.start()
    clip = make_clip(frames=6, height=48, width=64)
    with Client(w.uds_url, local_fallback=False) as c:
        first, template, forked = killed_mid_encode(c, w, clip, lambda template, writer: template)
        assert dead(forked)  # reaped by init (here a zombie: this sandbox's does not reap)
        again = write(c, "c.mp4", clip)  # afresh
        following = wait_for_template(w, frozenset({template}))
        last = write(c, "d.mp4", clip)  # forked from the new one
    assert again.sha256 == first.sha256 == last.sha256
    assert template not in w.children() and following != template


def test_the_template_is_the_workers_and_each_writer_a_group_of_its_own(workers):
    """The template runs in the worker's session (its scheduling group) at its weight:
    its forks and the statuses it reports are on encodes' paths, never starved behind
    the ranks. A writer forked for an encode that does not yield (this worker's: the
    suite's do not) is a new group at the worker's weight."""
    w = workers.start()
    clip = make_clip(frames=6, height=48, width=64)
    with Client(w.uds_url, local_fallback=False) as c:
        write(c, "a.mp4", clip)
        template = wait_for_template(w)
        assert os.getsid(template) == os.getsid(w.pid)
        assert (
            Path(f"/proc/{template}/autogroup").read_text()
            == Path(f"/proc/{w.pid}/autogroup").read_text()
        )
        assert os.getpriority(os.PRIO_PROCESS, template) == os.getpriority(os.PRIO_PROCESS, w.pid)
        writer, forked = running_writer(c, template, "b.mp4", clip)
        assert group_nice_of(forked) == 0 and os.getsid(forked) == forked
        writer.close()


def test_a_template_that_does_not_answer_is_let_go_within_a_bound(workers):
    """Stopped (SIGSTOP): the encode waits for its fork at most ANSWER_WITHIN_S, then
    starts its writer afresh; the template is killed and reaped, another started."""
    from framewire.service._encode.forks import ANSWER_WITHIN_S, GONE_WITHIN_S

    w = workers.start()
    clip = make_clip(frames=6, height=48, width=64)
    with Client(w.uds_url, local_fallback=False) as c:
        first = write(c, "a.mp4", clip)
        template = wait_for_template(w)
        settled(template)
        os.kill(template, signal.SIGSTOP)
        t0 = time.monotonic()
        again = write(c, "b.mp4", clip)
        assert time.monotonic() - t0 < ANSWER_WITHIN_S + GONE_WITHIN_S + 5
        following = wait_for_template(w, frozenset({template}))
        last = write(c, "c.mp4", clip)
    assert first.sha256 == again.sha256 == last.sha256
    assert dead(template) and template not in w.children() and following != template


def _encodes(forks, count: int) -> None:
    """``count`` writers started and closed, each followed by what its end starts."""
    from framewire.core.media.priority import FULL

    for _ in range(count):
        forks.start([], [], None, FULL).close()
        time.sleep(0.3)  # the template's start, START_AFTER_S (0 here) after


@pytest.mark.parametrize("pidfds", [True, False])
def test_templates_are_given_up_where_forking_cannot_work(monkeypatch, pidfds):
    """Templates that fork no writer (here: one that ends at once) are let go and replaced
    GIVE_UP_AFTER times in a row, then no more are started: each encode starts its writer
    afresh without a template's start beside it. Where pidfds cannot be made (a seccomp
    profile that refuses them), none is ever started."""
    from framewire.service._encode import forks as module

    monkeypatch.setattr(module, "START_AFTER_S", 0.0)
    monkeypatch.setattr(module, "pidfds_work", lambda: pidfds)
    started: list[object] = []

    class Counted(module.Template):
        def __init__(self, template: list[str]):
            started.append(self)
            super().__init__(template)

    monkeypatch.setattr(module, "Template", Counted)
    ends = [sys.executable, "-c", "pass"]
    forks = module.Forks([sys.executable, "-c", "import sys; sys.stdin.buffer.read()"], ends)
    try:
        _encodes(forks, module.GIVE_UP_AFTER + 3)
    finally:
        forks.close()
    assert len(started) == (module.GIVE_UP_AFTER if pidfds else 0)


def test_a_killed_worker_leaves_no_template_nor_writer_running(workers, tmp_path):
    """SIGKILL to the worker while a writer runs: its frames' pipe ends, it finishes (or
    fails) and exits; the template, its socket at its end and its writers reaped, exits.
    (The next worker on the same root removes the killed one's temp output.)"""
    w = workers.start(root=tmp_path / "host")
    clip = make_clip(frames=6, height=48, width=64)
    with Client(w.uds_url, local_fallback=False) as c:
        write(c, "a.mp4", clip)
        template = wait_for_template(w)
        writer, forked = running_writer(c, template, "b.mp4", clip)
        os.kill(w.pid, signal.SIGKILL)
        w.proc.wait()
        until(lambda: dead(forked) and dead(template), 10, "the template or its writer lives on")
        with pytest.raises(FramewireError):  # its worker gone (no fallback asked for)
            writer.close()
    workers.start(root=tmp_path / "host")
