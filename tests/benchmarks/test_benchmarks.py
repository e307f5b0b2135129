"""The benchmark scripts run, on clips small enough for CI, and their outputs agree.

Wall times are printed, never asserted; what is asserted is that each script
finishes, prints its table, finds framewire's bytes equal to its peers' (each
exits 1 otherwise) and draws its figures: PNG files that decode to an image.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO


def bench(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_figures(directory: Path, *names: str) -> None:
    """Exactly these PNGs were written, and each decodes to a picture of some size."""
    import matplotlib.image

    assert sorted(p.name for p in directory.iterdir()) == sorted(names)
    for name in names:
        path = directory / name
        assert path.read_bytes()[:8] == PNG_SIGNATURE, name
        pixels = matplotlib.image.imread(path)
        assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 300, pixels.shape
        assert pixels.std() > 0, f"{name} is blank"


def test_encode_benchmark(tmp_path: Path) -> None:
    out, figures = tmp_path / "rows.json", tmp_path / "figures"
    r = bench("encode.py", "--frames", "4", "--width", "64", "--height", "48",
              "--json", str(out), "--figures", str(figures))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert_figures(figures, "encode-memory.png", "encode-wall.png")
    rows = json.loads(out.read_text())
    assert {row["variant"] for row in rows} == {"bare ffmpeg", "imageio", "framewire"}
    assert all(row["same_bytes"] for row in rows), rows
    assert "framewire" in r.stdout


def test_overhead_benchmark() -> None:
    r = bench("overhead.py", "--repeat", "3", "--frames", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "over in-process" in r.stdout and "x bare ffmpeg" in r.stdout, r.stdout


def test_parallel_benchmark() -> None:
    r = bench("parallel.py", "--outputs", "1", "2", "--frames", "2", "--threads", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "parallel / serial" in r.stdout, r.stdout


def test_decode_benchmark(tmp_path: Path) -> None:
    out, figures = tmp_path / "results.json", tmp_path / "figures"
    r = bench("decode.py", "--ranks", "2", "--seconds", "0.5", "--json", str(out),
              "--figures", str(figures))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert_figures(figures, "decode.png")
    results = json.loads(out.read_text())
    assert {"one decode", "2 x framewire", "2 x framewire, cached"} <= set(results)
    assert "bytes identical across all ranks and variants: True" in r.stdout


def test_validate_benchmark() -> None:
    r = bench("validate.py", "--frames", "6", "--repeat", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "framewire, serial" in r.stdout and "goal: 4 outputs" in r.stdout, r.stdout


@pytest.mark.parametrize("args", [["--repeat", "0"], ["--frames", "-1"], ["--width", "x"]])
def test_counts_below_one_are_refused_up_front(args: list[str]) -> None:
    r = bench("encode.py", *args)
    assert r.returncode == 2 and "error: argument" in r.stderr, r.stderr


def test_gpu_benchmark_says_why_it_cannot_run() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: scripts/gpu-check runs this benchmark")
    r = bench("gpu_encode.py", "--frames", "2")
    assert r.returncode == 2 and "no CUDA device" in r.stderr, r.stdout + r.stderr


def test_stream_benchmark(tmp_path: Path) -> None:
    out, figures = tmp_path / "stream.json", tmp_path / "figures"
    r = bench("stream.py", "--frames", "8", "--chunk", "3", "--width", "64", "--height", "48",
              "--repeat", "1", "--json", str(out), "--figures", str(figures))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert_figures(figures, "stream-tail.png")
    rows = json.loads(out.read_text())["runs"]
    modes = sorted(row["mode"] for row in rows if row["rate"] > 0)
    assert modes == ["a", "a", "b", "b", "c", "c"]  # two rates, one run each
    assert len({row["sha256"] for row in rows}) == 1
    assert "same bytes (a), (b) and (c), every run: True" in r.stdout
    # The stream's extra memory is its two staging segments of 3 frames (a few KiB).
    assert all(row["extra_mib"] < 8 for row in rows if row["mode"] == "b"), rows


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


def test_live_benchmark(tmp_path: Path) -> None:
    from tests.support.browser import browser_missing

    missing = browser_missing()
    if missing is not None:
        pytest.skip(f"no browser can be installed here: {missing}")
    out = tmp_path / "live.json"
    r = bench("live.py", "--frames", "32", "--width", "64", "--height", "48",
              "--viewers", "0", "2", "--json", str(out))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads(out.read_text())
    assert [row["viewers"] for row in results["rows"]] == [0, 2]
    assert len({row["sha256"] for row in results["rows"]}) == 1
    watched = results["rows"][1]
    assert len(watched["delays_ms"]) == 3 and all(d > 0 for d in watched["delays_ms"])
    assert len(watched["http_viewer_bytes"]) == 1 and watched["http_viewer_bytes"][0] > 0


def test_node_benchmark(tmp_path: Path) -> None:
    out, figures = tmp_path / "node.json", tmp_path / "figures"
    r = bench("node.py", "--ranks", "2", "--frames", "8", "--width", "96", "--height", "64",
              "--repeat", "1", "--json", str(out), "--figures", str(figures))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert_figures(figures, "node.png")
    results = json.loads(out.read_text())
    rows, runs = results["rows"], results["runs"]
    assert [row["path"] for row in rows] == [
        "(a) bare ffmpeg", "(b) imageio", "(c) in-process pipe", "framewire save",
        "framewire stream",
    ]  # fmt: skip
    assert len(runs) == 10 and all(run["ranks"] == 2 for run in runs)  # 5 paths, timed + probed
    assert all(run["same"] for run in runs), runs
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
