"""The encode benchmarks (encode, overhead, parallel, validate, gpu_encode) run on clips
small enough for CI.

See tests/support/benchruns.py for what is asserted and what is not."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.benchruns import bench, bench_json


def test_encode_benchmark(tmp_path: Path) -> None:
    r, rows = bench_json(tmp_path, "encode.py", "--frames", "4", "--width", "64", "--height", "48",
                         figures=("encode-memory.png", "encode-wall.png"))  # fmt: skip
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


def test_validate_benchmark() -> None:
    r = bench("validate.py", "--frames", "6", "--repeat", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "framewire, serial" in r.stdout and "goal: 4 outputs" in r.stdout, r.stdout


@pytest.mark.parametrize(
    ("script", "args"),
    [("encode.py", ["--repeat", "0"]), ("encode.py", ["--frames", "-1"]),
     ("encode.py", ["--width", "x"]), ("decode.py", ["--size", "640"]),
     ("decode.py", ["--source", "0x480"])],
)  # fmt: skip
def test_counts_below_one_are_refused_up_front(script: str, args: list[str]) -> None:
    r = bench(script, *args)
    assert r.returncode == 2 and "error: argument" in r.stderr, r.stderr


def test_gpu_benchmark_says_why_it_cannot_run() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: scripts/gpu-check runs this benchmark")
    r = bench("gpu_encode.py", "--frames", "2")
    assert r.returncode == 2 and "no CUDA device" in r.stderr, r.stdout + r.stderr
