"""The engines benchmark runs each engine's own save off and on, on a clip small enough
for CI; what is asserted is that it runs and every byte agrees, never its timings."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.benchruns import bench_json

pytestmark = pytest.mark.registry


def test_engines_benchmark(tmp_path: Path) -> None:
    r, results = bench_json(tmp_path, "engines.py", "--frames", "8", "--width", "96",
                            "--height", "64", "--repeat", "1", timeout=600)  # fmt: skip
    engines = ["sglang", "vllm-omni", "vllm-omni-encoder", "vllm-omni-bytes", "diffusers"]
    assert [row["engine"] for row in results["rows"]] == engines
    assert all(row["same_bytes"] for row in results["rows"])
    assert len(results["runs"]) == 2 * len(engines)  # off and on, one run each
    assert "| sglang |" in r.stdout


def test_back_to_back_benchmark(tmp_path: Path) -> None:
    r, results = bench_json(tmp_path, "back_to_back.py", "--frames", "8", "--width", "64",
                            "--height", "48", "--saves", "2", "--repeat", "1", "--gaps", "0",
                            "--writers", "fresh", "forked", timeout=600)  # fmt: skip
    assert results["same_bytes"]
    assert [(row["gap_s"], row["writers"]) for row in results["rows"]] == [
        (0.0, None),
        (0.0, "fresh"),
        (0.0, "forked"),
    ]
    assert all(len(row["walls"]) == 2 for row in results["rows"])  # each run's saves
    assert all(len(row["cpu_s"]) == 1 and row["cpu_s"][0] > 0 for row in results["rows"])
    assert r.stdout.count("| gap s | off | fresh | forked |") == 2  # walls, then CPU
