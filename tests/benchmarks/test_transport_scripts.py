"""The decode, routes, objects, flood and early-upload benchmarks run on clips small enough
for CI.

See tests/support/benchruns.py for what is asserted and what is not."""

from __future__ import annotations

from pathlib import Path

from tests.support.benchruns import bench_json


def test_decode_benchmark(tmp_path: Path) -> None:
    r, results = bench_json(
        tmp_path, "decode.py", "--ranks", "2", "--seconds", "0.5", "--source", "320x180",
        "--size", "224x128", figures=("decode.png",),
    )  # fmt: skip
    assert {"one decode", "2 x framewire", "2 x framewire, cached"} <= set(results)
    assert "bytes identical across all ranks and variants: True" in r.stdout


def test_routes_benchmark(tmp_path: Path) -> None:
    r, rows = bench_json(tmp_path, "routes.py", "--frames", "4", "--width", "64", "--height", "48",
                         "--repeat", "1")  # fmt: skip
    assert {row["variant"] for row in rows} == {"bare ffmpeg", "named segment", "fd (sealed memfd)"}
    assert len({row["sha256"] for row in rows}) == 1
    assert all(row["worker_cpu_s"] >= 0 for row in rows if row["variant"] != "bare ffmpeg")
    assert "same bytes for every route and run: True" in r.stdout


def test_objects_benchmark(tmp_path: Path) -> None:
    r, rows = bench_json(tmp_path, "objects.py", "--frames", "4", "--width", "64", "--height", "48",
                         "--big-mib", "16", "--repeat", "1")  # fmt: skip
    assert "framewire s" in r.stdout and "16 MiB file" in r.stdout
    assert [row["same"] for row in rows] == [True, True]
    assert rows[1]["bytes"] == 16 << 20


def test_flood_benchmark(tmp_path: Path) -> None:
    r, rows = bench_json(tmp_path, "flood.py", "--frames", "4", "--width", "64", "--height", "48",
                         "--repeat", "1", "--clients", "2")  # fmt: skip
    assert [row["condition"] for row in rows] == ["quiet", "healthz", "readiness", "metrics"]
    assert all(len(row["encode_s"]) == 1 for row in rows)
    assert all(row["answers_per_s"] > 0 for row in rows[1:])
    assert "readiness flood / healthz flood:" in r.stdout


def test_early_upload_benchmark(tmp_path: Path) -> None:
    r, rows = bench_json(tmp_path, "early_upload.py", "--rates", "50", "--frames", "8", "16",
                         "--width", "64", "--height", "48", "--repeat", "1",
                         "--pace", "0")  # fmt: skip
    assert [row["case"] for row in rows] == ["8 frames", "16 frames"]
    for row in rows:
        assert set(row["runs"]) == {"after", "while"}
        assert all(run["finish_s"] > 0 for runs in row["runs"].values() for run in runs)
    assert "while / after:" in r.stdout
