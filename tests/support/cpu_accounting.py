"""Each test's CPU, with every process it started: a pytest plugin for finding where the
suite's time goes (not loaded by default).

    scripts/test -p tests.support.cpu_accounting [--durations=0 ...]

Each pytest process moves itself into a cgroup of its own (cgroup v1 ``cpuacct``, as
root), so the CPU of its workers, zygotes, ffmpeg and browsers is counted where it was
spent, whichever process forked them and however they were reparented. Every test's
CPU (setup, call and teardown), its process's own share of it and its wall go to
``.venv/test-cpu/<process>.jsonl`` (``FRAMEWIRE_TEST_CPU_DIR``), each file's wall and
CPU to ``file_walls.json`` beside them (the table tests/support/order.py reads); the run ends
with the files that took the most.
Where no group can be made there (no v1 ``cpuacct``, not root, a container that
refuses), it says so and counts nothing. ``FRAMEWIRE_TEST_CPUACCT`` names another hierarchy.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO, order

CPUACCT = Path(os.environ.get("FRAMEWIRE_TEST_CPUACCT") or "/sys/fs/cgroup/cpuacct")
OUT = Path(os.environ.get("FRAMEWIRE_TEST_CPU_DIR") or REPO / ".venv" / "test-cpu")
SHOWN = 25  # files in the summary


def _usage(group: Path) -> float:
    return int((group / "cpuacct.usage").read_text()) / 1e9


def _own() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


class _Counter:
    def __init__(self, name: str) -> None:
        self.group = CPUACCT / f"framewire-tests-{name}-{os.getpid()}"
        self.group.mkdir(exist_ok=True)
        (self.group / "tasks").write_text(str(os.getpid()))  # and whatever it starts
        OUT.mkdir(parents=True, exist_ok=True)
        self.out = (OUT / f"{name}.jsonl").open("w")

    def record(self, test: str, cpu: float, own: float, wall: float) -> None:
        line = {"test": test, "cpu_s": round(cpu, 3), "own_s": round(own, 3), "wall_s": wall}
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()


_counter: _Counter | None = None


def refusal() -> str | None:
    """Why no process could be counted here, or None: makes a group, moves a child into it."""
    group = CPUACCT / f"framewire-tests-probe-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as exc:
        return str(exc)
    try:
        join = f"import os; open({str(group / 'tasks')!r}, 'w').write(str(os.getpid()))"
        child = subprocess.run(
            [sys.executable, "-c", join], capture_output=True, text=True, timeout=30
        )
        if child.returncode:
            return (child.stderr.strip().splitlines() or [f"exit {child.returncode}"])[-1]
        return None
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()  # its one task has exited


def pytest_configure(config: pytest.Config) -> None:
    global _counter
    # xdist's worker id from its own input, not PYTEST_XDIST_WORKER: a pytest that a test
    # starts inherits that variable, and would write over its parent's file.
    worker = getattr(config, "workerinput", None)
    name = worker["workerid"] if worker is not None else "main"
    if name == "main":  # first (xdist's processes start later): this run's files only
        for old in OUT.glob("*.jsonl"):
            old.unlink()
    if worker is not None or not config.pluginmanager.hasplugin("dsession"):
        try:
            _counter = _Counter(name)
        except OSError as exc:
            print(f"cpu_accounting: no cgroup to count in ({exc}): nothing is counted")


def pytest_unconfigure() -> None:
    if _counter is not None:
        _counter.out.close()
        try:  # back to the root group; this one goes once what this process started has
            (CPUACCT / "tasks").write_text(str(os.getpid()))
            _counter.group.rmdir()
        except OSError:
            pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    if _counter is None:
        yield
        return
    cpu, own, wall = _usage(_counter.group), _own(), time.monotonic()
    yield
    _counter.record(item.nodeid, _usage(_counter.group) - cpu, _own() - own,
                    round(time.monotonic() - wall, 3))  # fmt: skip


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if hasattr(terminalreporter.config, "workerinput"):
        return
    by_file: collections.Counter[str] = collections.Counter()
    walls: collections.Counter[str] = collections.Counter()
    for path in OUT.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            name = row["test"].split("::")[0]
            by_file[name] += row["cpu_s"]
            walls[name] += row["wall_s"]
    if not by_file:
        return
    order.write(walls, by_file, OUT / "file_walls.json")
    write = terminalreporter.write_line
    write(f"CPU of the tests, their processes included: {sum(by_file.values()):.1f} s "
          f"(per test: {OUT}/*.jsonl; each file's: {OUT}/file_walls.json, the order "
          f"of a parallel run once copied to {order.WALLS}); the {SHOWN} files that took "
          f"the most:")  # fmt: skip
    for name, cpu in by_file.most_common(SHOWN):
        write(f"{cpu:8.1f} s CPU {walls[name]:8.1f} s wall  {name}")
