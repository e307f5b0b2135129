"""The encode benchmarks (encode, overhead, parallel, validate, gpu_encode) run on clips
small enough for CI.

See tests/support/benchruns.py for what is asserted and what is not."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.support import REPO
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


def test_the_memory_samplers_know_an_ffmpeg_run_from_a_descriptor(monkeypatch) -> None:
    """The worker runs ffmpeg from a descriptor (/proc/self/fd/N): the process's Name is
    then that number, and benchmarks that looked for "ffmpeg" there missed every
    encoder's memory. They go by the executable's file name."""
    import importlib.util

    from framewire.core.media.binary import Binary
    from framewire.core.media.process import FfmpegProcess, find_ffmpeg

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # its harness and plots
    spec = importlib.util.spec_from_file_location("bench_encode", REPO / "benchmarks/encode.py")
    assert spec is not None and spec.loader is not None
    encode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(encode)
    binary = Binary(find_ffmpeg())  # run as the worker runs it: /proc/self/fd/N
    argv = [binary.exe, "-f", "rawvideo", "-s", "16x16", "-pix_fmt", "rgb24", "-i", "pipe:0",
            "-f", "null", "-"]  # fmt: skip
    with FfmpegProcess(argv) as ff:  # waits on its stdin
        pid = str(ff.proc.pid)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}/exe").resolve().name.startswith("python"):
            assert time.monotonic() < deadline, "ffmpeg was never exec'd"
            time.sleep(0.01)
        name, hwm = encode.status_kib(pid, ("VmHWM:",))
        assert name.startswith("ffmpeg") and hwm > 0, (name, hwm)
    binary.close()


def test_template_start_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "template.json"
    r = bench("template_start.py", "--repeat", "1", "--forks", "2", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "| service/_encode/pyav_template.py |" in r.stdout, r.stdout
    (row,) = json.loads(out.read_text())
    assert row["template"] == "service/_encode/pyav_template.py"
    assert len(row["cpu_s"]) == 1 and 0 < row["cpu_s"][0] < 5
    assert len(row["rss_mib"]) == 1 and 10 < row["rss_mib"][0] < 500
    assert len(row["fork_ms"]) == 2 and all(0 < ms < 5000 for ms in row["fork_ms"])
