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
