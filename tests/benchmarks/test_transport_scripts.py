"""The decode, routes and objects benchmarks run on clips small enough for CI.

See tests/support/benchruns.py for what is asserted and what is not."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.benchruns import assert_figures, bench


def test_decode_benchmark(tmp_path: Path) -> None:
    out, figures = tmp_path / "results.json", tmp_path / "figures"
    r = bench("decode.py", "--ranks", "2", "--seconds", "0.5", "--json", str(out),
              "--figures", str(figures))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert_figures(figures, "decode.png")
    results = json.loads(out.read_text())
    assert {"one decode", "2 x framewire", "2 x framewire, cached"} <= set(results)
    assert "bytes identical across all ranks and variants: True" in r.stdout


def test_routes_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "routes.json"
    r = bench("routes.py", "--frames", "4", "--width", "64", "--height", "48", "--repeat", "1",
              "--json", str(out))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    assert {row["variant"] for row in rows} == {"bare ffmpeg", "named segment", "fd (sealed memfd)"}
    assert len({row["sha256"] for row in rows}) == 1
    assert all(row["worker_cpu_s"] >= 0 for row in rows if row["variant"] != "bare ffmpeg")
    assert "same bytes for every route and run: True" in r.stdout


def test_objects_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "objects.json"
    r = bench("objects.py", "--frames", "4", "--width", "64", "--height", "48", "--big-mib", "16",
              "--repeat", "1", "--json", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "framewire s" in r.stdout and "16 MiB file" in r.stdout
    rows = json.loads(out.read_text())
    assert [row["same"] for row in rows] == [True, True]
    assert rows[1]["bytes"] == 16 << 20
