"""A child forked for the worker by another process: its status is its parent's word on a
pipe; a parent gone without saying leaves it killed, never running on unwatched; every
wait is bounded and its descriptors go once its status is known."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from framewire.core.media.adopted import LOST, Adopted


def _sleeper() -> tuple[subprocess.Popen[bytes], Adopted, int]:
    """A sleeping child (this process its parent here, as the template is the writer's),
    adopted: (its Popen, the adopted face, the status pipe's write end)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    status_read, status = os.pipe2(os.O_CLOEXEC)
    return child, Adopted(child.pid, os.pidfd_open(child.pid), status_read), status


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_status_is_the_parents_word():
    before = _open_fds()
    child, adopted, status = _sleeper()
    try:
        assert adopted.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            adopted.wait(timeout=0.05)
        adopted.kill()
        code = child.wait(10)  # the parent reaps it, then says
        os.write(status, b"%d\n" % code)
        os.close(status)
        assert adopted.wait(timeout=5) == -signal.SIGKILL == adopted.poll()
        adopted.kill()  # its status known: nothing is signalled
    finally:
        child.kill()
        child.wait()
    assert _open_fds() == before  # the pidfd and the status pipe went with its status


def test_a_parent_gone_without_saying_leaves_the_child_killed():
    child, adopted, status = _sleeper()
    try:
        os.close(status)  # the parent died: no status will come
        t0 = time.monotonic()
        assert adopted.wait(timeout=5) == LOST
        assert time.monotonic() - t0 < 5
        # Killed, not left running, and reaped: this process is its parent here, as a
        # worker that is a container's PID 1 is an orphaned writer's.
        assert not os.path.exists(f"/proc/{child.pid}")
    finally:
        child.kill()
        child.wait()


def test_a_said_exit_needs_no_signal():
    child, adopted, status = _sleeper()
    try:
        os.write(status, b"3\n")
        assert adopted.poll() == 3
        assert child.poll() is None  # a status said is taken as said
    finally:
        child.kill()
        child.wait()
        os.close(status)


def test_a_release_kills_a_running_child_and_waits_for_nothing():
    """Its parent reaps it: the release neither waits for its exit nor for the status."""
    before = _open_fds()
    child, adopted, status = _sleeper()
    try:
        t0 = time.monotonic()
        adopted.release()
        assert time.monotonic() - t0 < 0.5 and adopted.poll() == -signal.SIGKILL
        assert child.wait(5) == -signal.SIGKILL  # killed, reaped by its parent
        adopted.kill()  # released: nothing is signalled
    finally:
        child.kill()
        child.wait()
        os.close(status)
    assert _open_fds() == before


def test_a_release_takes_a_status_already_said():
    child, adopted, status = _sleeper()
    try:
        os.write(status, b"0\n")
        adopted.release()
        assert adopted.returncode == 0 and child.poll() is None  # not killed
    finally:
        child.kill()
        child.wait()
        os.close(status)
