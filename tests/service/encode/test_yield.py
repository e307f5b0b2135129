"""Encodes yield to the ranks: by default an encoder's threads run at niceness 19 under
SCHED_BATCH (the settings choose, or turn it off), in a session and so an autogroup of
its own whose niceness is the same (the ranks' session is weighed against it, wherever
the worker runs), the worker's own threads never do, and an encode beside a load that
takes every core still finishes, with its bytes."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import time
from pathlib import Path

import pytest
from framewire.client import Client

from tests.service.encode.test_small_lane import priority_of_threads, running_encoder
from tests.support.identity import as_nobody
from tests.support.media import make_clip, reference_mp4
from tests.support.real import needs_root


def session_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])


def autogroup_of(pid: int) -> tuple[str, int]:
    """The autogroup ``pid`` is in, and that group's niceness (/proc/PID/autogroup). The
    kernel prints nothing for the root group, where every session not made since boot
    stays (a CI runner's processes, started without ``setsid``): named "root" here, at 0."""
    fields = Path(f"/proc/{pid}/autogroup").read_text().split()
    if not fields:
        return "root", 0
    name, _, nice = fields
    return name, int(nice)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ((), {(19, "batch")}),  # the default
        (("--encode-sched", "idle"), {(19, "idle")}),
        (("--encode-nice", "5", "--encode-sched", "normal"), {(5, "normal")}),
        (("--encode-nice", "0", "--encode-sched", "normal"), {(0, "normal")}),  # off
    ],
    ids=["default", "idle", "nice-only", "off"],
)
def test_an_encoders_threads_run_at_the_priority_the_settings_say(workers, flags, expected):
    """Seen on a stream session's encoder (big encodes' rules: a session never takes the
    small lane), which waits for the next chunk with every thread made, using no CPU."""
    w = workers.start(*flags, yielding=True)
    clip = make_clip(frames=8, height=256, width=256)
    with Client(w.uds_url, local_fallback=False) as c:
        writer = c.open_video("watched.mp4", fps=24, threads=2)
        writer.write(clip)
        try:
            ffmpeg = running_encoder(w)
            assert priority_of_threads(ffmpeg) == expected, "every thread, x264's included"
            assert priority_of_threads(w.pid) == {(0, "normal")}  # the worker: its loop first
            [(nice, _)] = expected
            if nice == 0:  # not yielding: the worker's session, its group
                assert session_of(ffmpeg) == session_of(w.pid)
                assert autogroup_of(ffmpeg) == autogroup_of(w.pid)
            else:  # a session, a scheduling group, of its own, at the encoder's niceness
                assert session_of(ffmpeg) == ffmpeg != session_of(w.pid)
                group, group_nice = autogroup_of(ffmpeg)
                assert group != autogroup_of(w.pid)[0] and group_nice == nice
                assert autogroup_of(w.pid)[1] == 0  # the worker's own group keeps its weight
        finally:
            writer.abort()


def _spin(until: float) -> None:
    while time.monotonic() < until:
        pass


def test_an_encode_beside_a_load_on_every_core_finishes_with_its_bytes(workers, tmp_path):
    """One busy process per CPU (and one more) at the ranks' priority for up to a minute: a
    niced SCHED_BATCH encoder still gets its share (CFS gives every runnable thread a
    weight: 15 at niceness 19 against 1024), so the encode ends, byte-exact, in bounds."""
    w = workers.start(yielding=True)
    clip = make_clip(frames=24, height=96, width=128)
    expected = reference_mp4(clip, tmp_path / "ref.mp4")
    ctx = multiprocessing.get_context("fork")
    until = time.monotonic() + 60
    hogs = [ctx.Process(target=_spin, args=(until,), daemon=True)
            for _ in range(len(os.sched_getaffinity(0)) + 1)]  # fmt: skip
    for hog in hogs:
        hog.start()
    try:
        time.sleep(0.5)  # the load in place before the encode starts
        started = time.monotonic()
        with Client(w.uds_url, local_fallback=False, timeout=120) as c:
            result = c.save_video(clip, "loaded.mp4", fps=24)
        took = time.monotonic() - started
        still_loaded = all(h.is_alive() for h in hogs)
    finally:
        for hog in hogs:
            hog.kill()
            hog.join(10)
    print(f"\nencode beside {len(hogs)} busy processes: {took:.1f} s")
    assert result.sha256 == expected
    # The order is the claim: the encode ended while every busy process still ran (they
    # stop at 60 s; the client's own bound is 120 s). How long it took is a figure.
    assert still_loaded, "the load ended before the encode did: nothing was shown"


def _three_sessions_niced() -> tuple[list[int], int]:
    """As an unprivileged worker would: three sessions' groups given niceness 19 at once;
    their niceness once no write waits (or 3 s passed), and how many the kernel refused
    at first."""
    from framewire.core.media import priority

    children = [subprocess.Popen(["sleep", "30"], start_new_session=True) for _ in range(3)]
    try:
        time.sleep(2 * priority.GROUP_RETRY_EVERY_S)  # no one else's write in our tenth
        for child in children:
            priority.group_nice(child.pid, 19)
        refused = priority.LATER.waiting()
        deadline = time.monotonic() + 3
        while priority.LATER.waiting() and time.monotonic() < deadline:
            time.sleep(0.02)
        return [autogroup_of(child.pid)[1] for child in children], refused
    finally:
        for child in children:
            child.kill()
            child.wait()


@needs_root
def test_group_niceness_the_kernel_refuses_for_now_is_set_once_it_takes_it():
    """Without CAP_SYS_ADMIN the kernel takes one autogroup niceness a tenth of a second,
    host-wide, and refuses the others (EAGAIN): encoders started together by a worker not
    run as root kept the ranks' weight, all but the first. They are retried now."""
    if Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() != "1":
        pytest.skip("autogroup is off in this kernel: no group to weigh")
    result = as_nobody(_three_sessions_niced)
    assert isinstance(result, tuple), result
    nices, refused = result
    assert refused >= 1, "the kernel took every write at once: nothing here was retried"
    assert nices == [19, 19, 19]
