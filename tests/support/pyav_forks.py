"""The PyAV template and its writers as a test sees them: found by their parent and
their names (``pyav-spare``, ``pyav-writer``), their CPU and descriptors read from /proc,
and a wait for each."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import av
from framewire.client import Client, pyav_identity
from framewire.core.media.procstat import stat_fields

from tests.support.processes import child_pids
from tests.support.worker import Worker

ENCODER = pyav_identity(av.__version__)
T = TypeVar("T")


def templates(w: Worker) -> list[int]:
    """The worker's PyAV templates (one at most)."""
    found = []
    for pid in w.children():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(b"/pyav_template.py") for arg in argv):
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


def wait_for_template(w: Worker, other_than: frozenset[int] = frozenset()) -> int:
    ready = until(
        lambda: [p for p in templates(w) if p not in other_than], 30, "no template was started"
    )
    [pid] = ready
    return pid


def write(c: Client, name: str, clip, **kw) -> object:
    with c.open_video(name, fps=24, profile="vllm-omni", encoder=ENCODER, **kw) as writer:
        writer.write(clip)
    return writer.result


def named(pids: set[int], name: str) -> set[int]:
    """Those of ``pids`` that call themselves ``name`` (/proc/PID/comm)."""
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                found.add(pid)
    return found


def writers_of(template: int) -> set[int]:
    """The template's children that run a job (not the spare waiting for one)."""
    return named(child_pids(template), "pyav-writer")


def spare_of(template: int) -> int:
    """The writer the template has forked ahead, once it has."""
    [pid] = until(lambda: named(child_pids(template), "pyav-spare"), 10, "no spare was forked")
    return pid


def steady_fds(pid: int) -> int:
    """How many descriptors ``pid`` holds, once two looks 0.2 s apart agree (a spare's
    fork holds a pipe and a socket for a moment)."""
    seen = -1
    for _ in range(50):
        now = len(os.listdir(f"/proc/{pid}/fd"))
        if now == seen:
            return now
        seen = now
        time.sleep(0.2)
    raise AssertionError(f"{pid}'s descriptors never held still")


def running_writer(c: Client, template: int, name: str, clip, **kw):
    """An encode whose writer has its frames (flushed): (the open writer, its pid)."""
    writer = c.open_video(name, fps=24, profile="vllm-omni", encoder=ENCODER, **kw)
    writer.write(clip)
    writer.flush()
    [pid] = until(lambda: writers_of(template), 10, "no writer was forked")
    return writer, pid


def dead(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is None or fields[0] == b"Z"


def group_nice_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])


def cpu_ticks(pid: int) -> tuple[int, int]:
    """Its own CPU ticks (user and system) and those of its children it reaped."""
    fields = stat_fields(pid)
    assert fields is not None, f"{pid} is gone"
    return int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])


def settled(pid: int) -> tuple[int, int]:
    """Its CPU ticks once they stand still for 0.3 s (a template waiting for jobs)."""
    seen = cpu_ticks(pid)
    for _ in range(100):
        time.sleep(0.3)
        if (now := cpu_ticks(pid)) == seen:
            return now
        seen = now
    raise AssertionError(f"{pid} never settled")
