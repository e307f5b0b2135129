"""The node benchmark runs on a clip small enough for CI.

See tests/support/benchruns.py for what is asserted and what is not."""

from __future__ import annotations

from pathlib import Path

from tests.support.benchruns import bench_json

# Two ranks of 8 frames 96x64, one run of each path: small enough for CI.
SMALL = [
    "--ranks",
    "2",
    "--frames",
    "8",
    "--width",
    "96",
    "--height",
    "64",
    "--repeat",
    "1",
    "--idle-s",
    "1",
]
FIGURES = ("node.png",)


def test_node_benchmark(tmp_path: Path) -> None:
    r, results = bench_json(tmp_path, "node.py", *SMALL, figures=FIGURES)
    rows, runs = results["rows"], results["runs"]
    assert [row["path"] for row in rows] == [
        "(a) bare ffmpeg", "(b) imageio", "(c) in-process pipe", "framewire save",
        "framewire stream",
    ]  # fmt: skip
    assert len(runs) == 10 and all(run["ranks"] == 2 for run in runs)  # 5 paths, timed + probed
    assert all(run["same"] for run in runs), runs
    # Each rank decoded the reference beside its save (through the worker, or with an
    # ffmpeg of its own as an engine without it), each decode equal to the local one
    # ("same"); but the bare ffmpegs, the encoder's own bound.
    assert all(run["decodes"] == (0 if run["path"] == "bare" else 2) for run in runs)
    # What the node held, in its four parts; the worker's only in the worker's runs.
    for run in runs:
        parts = run["memory_parts_mib"]
        assert set(parts) == {"ranks", "worker", "encoders", "shared"}, parts
        assert run["path"] in ("save", "stream") or parts["worker"] == 0, run
    # Every probed run timed its probes; the idle ones too.
    assert all(run["probes"]["health_ms"] and run["probes"]["tiny_ms"]
               for run in runs if run["probed"])  # fmt: skip
    assert results["idle"]["health_ms"] and results["idle"]["tiny_ms"]
    assert "| 2 | framewire stream |" in r.stdout
    assert "every output equal to its rank's reference, every decode to the local one: True" in (
        r.stdout
    )


def test_node_benchmark_saves_alone(tmp_path: Path) -> None:
    """``--reference none``: every row saves alone, no rank decodes."""
    _, results = bench_json(tmp_path, "node.py", *SMALL, "--reference", "none", figures=FIGURES)
    runs = results["runs"]
    assert len(runs) == 10 and all(run["same"] for run in runs), runs
    assert all(run["decodes"] == 0 for run in runs), runs
    assert "reference decode: none" in results["setup"]
