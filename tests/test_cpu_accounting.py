"""The suite's CPU accounting (tests/support/cpu_accounting.py) counts a test's children."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.cpu_accounting import CPUACCT

BURN = """
import subprocess, sys

def test_burns_in_a_child():
    subprocess.run([sys.executable, "-c", "x = 0\\nfor i in range(4_000_000): x += i"], check=True)

def test_idles():
    pass
"""


@pytest.mark.skipif(not os.access(CPUACCT, os.W_OK), reason=f"no writable {CPUACCT} (root, v1)")
def test_a_tests_cpu_counts_the_processes_it_starts(tmp_path: Path) -> None:
    (tmp_path / "test_burn.py").write_text(BURN)
    out = tmp_path / "cpu"
    env = os.environ | {"PYTHONPATH": str(REPO), "FRAMEWIRE_TEST_CPU_DIR": str(out)}
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-p", "tests.support.cpu_accounting", "test_burn.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    rows = {r["test"]: r for r in map(json.loads, (out / "main.jsonl").read_text().splitlines())}
    burnt, idle = rows["test_burn.py::test_burns_in_a_child"], rows["test_burn.py::test_idles"]
    assert burnt["cpu_s"] > 0.1 > burnt["own_s"]  # the child's, not the test process's
    assert idle["cpu_s"] < 0.05
    assert "CPU of the tests, their processes included" in ran.stdout
