"""The ranks benchmark runs on a clip small enough for CI (big enough not to take the small
lane, whose encodes never yield). See tests/support/benchruns.py for what is asserted."""

from __future__ import annotations

from pathlib import Path

from tests.support.benchruns import bench_json


def test_ranks_benchmark(tmp_path: Path) -> None:
    r, results = bench_json(tmp_path, "ranks.py", "--encodes", "1", "--frames", "8",
                            "--width", "160", "--height", "96", "--ranks", "1", "--step-ms", "5",
                            "--repeat", "1", "--alone-s", "0.5", "--probe-s", "1",
                            "--settings", "yield", "no yield")  # fmt: skip
    rows = {row["name"]: row for row in results["rows"]}
    # (the idle policy, the slowest to run beside busy ranks, only in the full run)
    assert list(rows) == ["alone", "yield", "no yield", "in-process"]
    assert results["sha256_equal"]
    for name, row in rows.items():
        assert row["steps"][0] > 0 and row["step_mean_ms"] > 0, row  # the ranks stepped
        assert name == "alone" or (row["wall_s"] > 0 and row["bare_wall_s"] > 0), row
    assert len(rows["alone"]["step_means_ms"]) == 3  # one before each window
    probes = results["probes"]
    assert list(probes) == ["idle host", "ranks alone", "yield", "no yield"]
    assert all(got["health_ms"] and got["tiny_ms"] for [got] in probes.values())
    assert "(goal <= 1.05:" in r.stdout and "x ranks alone" in r.stdout
