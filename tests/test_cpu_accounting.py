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


def test_without_a_group_the_run_passes_and_says_nothing_was_counted(tmp_path: Path) -> None:
    ran, out = _run(tmp_path, FRAMEWIRE_TEST_CPUACCT=str(tmp_path / "no-cgroup"))
    assert "cpu_accounting: no cgroup to count in" in ran.stdout
    assert "2 passed" in ran.stdout
    assert not list(out.glob("*.jsonl")) and "CPU of the tests" not in ran.stdout
