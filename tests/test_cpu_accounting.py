"""The suite's CPU accounting (tests/support/cpu_accounting.py) counts a test's children,
and where the host refuses it a group, the run goes on and says that nothing was counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.cpu_accounting import refusal
from tests.support.order import EVERY, LEAD, WALLS, in_order

BURN = """
import subprocess, sys

def test_burns_in_a_child():
    subprocess.run([sys.executable, "-c", "x = 0\\nfor i in range(4_000_000): x += i"], check=True)

def test_idles():
    pass
"""


def _run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    (tmp_path / "test_burn.py").write_text(BURN)
    out = tmp_path / "cpu"
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-p", "tests.support.cpu_accounting", "test_burn.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=os.environ | {"PYTHONPATH": str(REPO), "FRAMEWIRE_TEST_CPU_DIR": str(out),
                          "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"} | env,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    return ran, out


def test_a_tests_cpu_counts_the_processes_it_starts(tmp_path: Path) -> None:
    if (why := refusal()) is not None:
        pytest.skip(f"this host makes no cpuacct group for a child: {why}")
    ran, out = _run(tmp_path)
    rows = {r["test"]: r for r in map(json.loads, (out / "main.jsonl").read_text().splitlines())}
    burnt, idle = rows["test_burn.py::test_burns_in_a_child"], rows["test_burn.py::test_idles"]
    assert burnt["cpu_s"] > 0.1 > burnt["own_s"]  # the child's, not the test process's
    assert idle["cpu_s"] < 0.05
    assert "CPU of the tests, their processes included" in ran.stdout
    # Each file's wall and CPU, the table a parallel run's order comes from
    # (tests/support/order.py).
    table = json.loads((out / "file_walls.json").read_text())
    assert list(table) == ["test_burn.py"]
    assert table["test_burn.py"]["wall"] >= burnt["wall_s"] - 0.1
    assert table["test_burn.py"]["cpu"] >= burnt["cpu_s"] - 0.1


def test_a_parallel_run_hands_out_the_longest_files_first_and_spreads_those_that_wait() -> None:
    class Item:
        def __init__(self, nodeid: str) -> None:
            self.nodeid = nodeid

    busy = {f"b{i}.py": {"wall": 100.0 - i, "cpu": 50.0 - i} for i in range(14)}
    waiting = {"w0.py": {"wall": 99.5, "cpu": 1.0}, "w1.py": {"wall": 40.0, "cpu": 2.0}}
    table = {**busy, **waiting}
    files = ["w1.py", *sorted(busy, reverse=True), "new.py", "w0.py"]
    items = [Item(f"{f}::t{k}") for f in files for k in range(2)]
    in_order(items, table)  # type: ignore[arg-type]
    got = list(dict.fromkeys(item.nodeid.split("::")[0] for item in items))
    # A file not in the table first; LEAD busy ones, longest first; then a waiting one
    # after every EVERY busy ones; each file's tests stay together and in order.
    lead, every = [f"b{i}.py" for i in range(LEAD)], [f"b{i}.py" for i in range(LEAD, 14)]
    assert got == ["new.py", *lead, "w0.py", *every[:EVERY], "w1.py", *every[EVERY:]]
    assert [item.nodeid for item in items[:2]] == ["new.py::t0", "new.py::t1"]


def test_the_committed_order_names_files_of_this_suite() -> None:
    table = json.loads(WALLS.read_text())
    assert table and all((REPO / name).is_file() for name in table), "stale tests/file_walls.json"
    walls = [row["wall"] for row in table.values()]
    assert walls == sorted(walls, reverse=True)


def test_without_a_group_the_run_passes_and_says_nothing_was_counted(tmp_path: Path) -> None:
    ran, out = _run(tmp_path, FRAMEWIRE_TEST_CPUACCT=str(tmp_path / "no-cgroup"))
    assert "cpu_accounting: no cgroup to count in" in ran.stdout
    assert "2 passed" in ran.stdout
    assert not list(out.glob("*.jsonl")) and "CPU of the tests" not in ran.stdout
