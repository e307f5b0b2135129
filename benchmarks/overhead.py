"""Request overhead of the HTTP worker, and a full-size encode through it.

    .venv/bin/python benchmarks/overhead.py [--repeat 40] [--frames 120] [--big-repeat 1]

1. A 16x16, 4-frame float32 clip: the same encode in-process (Encoder over a
   TensorSource) and through a worker over its Unix socket with the Python
   client: on the fd handover (frames copied into a sealed memfd, registered over
   the fd socket, HTTP, encode, validation, unregistered), without validation,
   and on the named-segment route. The paths take turns, round after round, so
   drift hits them alike; the overhead is the difference of the medians.
   Goal: <= 5 ms (benchmarks/README.md).
2. A 1344x768 float32 clip of --frames frames already in a POSIX shm segment:
   bare ffmpeg reading the converted rgb24 from /dev/shm, against one
   `POST /v1/videos:encode` of the segment (the worker reads it with pread,
   converts in chunks and streams). Same argv, same thread count, so the bytes
   must match. Goal: <= 1.10x bare ffmpeg.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from encode import write_clip  # noqa: E402  (the shared clip generator)
from framewire.client import Client  # noqa: E402
from framewire.core.media.argv import encode_argv, x264_auto_threads  # noqa: E402
from framewire.core.media.process import resolve_ffmpeg  # noqa: E402
from framewire.service._encode.encoder import EncodeParams, Encoder  # noqa: E402
from framewire.service._sources.frames import TensorSource  # noqa: E402

from tests.support.worker import start_worker  # noqa: E402


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def tiny(worker, work: Path, repeat: int) -> list[tuple[str, float, float]]:  # type: ignore[no-untyped-def]
    clip = torch.rand(3, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    encoder = Encoder()
    local_dir = work / "local"
    local_dir.mkdir()
    nowhere = work / "no-fd.sock"  # a named fd socket nobody serves: named segments
    with Client(worker.uds_url) as client, Client(worker.uds_url, fd_socket=nowhere) as shm:
        for i in range(5):  # warm every path
            encoder.encode(TensorSource(clip), local_dir / f"w{i}.mp4", EncodeParams(fps=24))
            client.save_video(clip, f"w{i}.mp4", fps=24)
            shm.save_video(clip, f"ws{i}.mp4", fps=24)
        assert (client.host_route, shm.host_route) == ("fd", "shm")
        rows: list[tuple[str, Any]] = []
        for name, fn in [
            ("in-process Encoder.encode", lambda i: encoder.encode(
                TensorSource(clip), local_dir / f"{i}.mp4", EncodeParams(fps=24))),
            ("worker, fd handover, validate", lambda i: client.save_video(
                clip, f"v{i}.mp4", fps=24)),
            ("worker, fd handover, no validate", lambda i: client.save_video(
                clip, f"n{i}.mp4", fps=24, validate=False)),
            ("worker, named segment, validate", lambda i: shm.save_video(
                clip, f"s{i}.mp4", fps=24)),
        ]:  # fmt: skip
            rows.append((name, fn))
        # Interleaved: each round times every path once, so drift hits them alike.
        times: dict[str, list[float]] = {name: [] for name, _ in rows}
        for i in range(repeat):
            for name, fn in rows:
                times[name] += harness.timed_ms(lambda _, i=i, fn=fn: fn(i), 1)
    return [(name, statistics.median(xs), p90(xs)) for name, xs in times.items()]


def big(worker, work: Path, frames: int, repeat: int) -> list[tuple[str, float, str]]:  # type: ignore[no-untyped-def]
    height, width = 768, 1344
    threads = x264_auto_threads(height)
    key = f"/framewire-bench-overhead-{os.getpid()}"
    segment, rgb = Path(f"/dev/shm{key}"), Path(f"/dev/shm{key.lstrip('/')}.rgb")
    try:
        write_clip(segment, rgb, frames, height, width)
        bare_out = work / "bare.mp4"
        argv = encode_argv(
            resolve_ffmpeg(None), width=width, height=height, fps=24, output=bare_out,
            threads=threads, stdin_name=str(rgb), guard=False,
        )  # fmt: skip
        bare = harness.timed_ms(lambda i: subprocess.run(argv, check=True), repeat)
        size = segment.stat().st_size
        body = {
            "outputs": [{
                "source": {"kind": "shm", "key": key, "offset": 0, "byte_size": size,
                           "dtype": "float32", "shape": [3, frames, height, width]},
                "path": "big.mp4", "fps": 24, "threads": threads,
            }]
        }  # fmt: skip
        answers = []
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(worker.uds)), timeout=600) as h:

            def post(i: int) -> None:
                r = h.post("http://framewire/v1/videos:encode", json=body)
                r.raise_for_status()
                answers.append(r.json()["outputs"][0])

            through = harness.timed_ms(post, repeat)
        same = answers[-1]["sha256"] == sha256(bare_out)
        route = answers[-1]["route"]
        b, w = statistics.median(bare), statistics.median(through)
        return [
            ("bare ffmpeg (rgb24 file in /dev/shm)", b / 1e3, "1.00x"),
            (f"worker, shm float32, route {route}, same bytes {'yes' if same else 'NO'}",
             w / 1e3, f"{w / b:.2f}x"),
        ]  # fmt: skip
    finally:
        segment.unlink(missing_ok=True)
        rgb.unlink(missing_ok=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--repeat", type=harness.count, default=40, help="tiny-clip repetitions")
    parser.add_argument(
        "--frames", type=harness.count, default=120, help="frames of the 1344x768 clip"
    )
    parser.add_argument("--big-repeat", type=harness.count, default=1)
    parser.add_argument("--skip-big", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="framewire-overhead-") as tmp:
        work = Path(tmp)
        worker = start_worker(work / "worker", "--log-level", "warning")
        try:
            rows = tiny(worker, work, args.repeat)
            big_rows = [] if args.skip_big else big(worker, work, args.frames, args.big_repeat)
        finally:
            worker.stop()
    base = rows[0][1]
    print(f"\nRequest overhead, 16x16x4 float32, {args.repeat} runs, {os.cpu_count()} CPUs")
    print(f"| {'path':<34} | median ms | p90 ms | over in-process |")
    print(f"|{'-' * 36}|-----------|--------|-----------------|")
    for name, med, p in rows:
        print(f"| {name:<34} | {med:9.2f} | {p:6.2f} | {med - base:+13.2f} ms |")
    worst = max(med - base for _, med, _ in rows[1:])
    print(f"goal: <= 5 ms over the encode itself -> {'PASS' if worst <= 5 else 'MISS'} "
          f"(worst {worst:.2f} ms)")  # fmt: skip
    if big_rows:
        print(f"\n1344x768, {args.frames} frames float32, median of {args.big_repeat}")
        print(f"| {'path':<62} | wall s | x bare ffmpeg |")
        print(f"|{'-' * 64}|--------|---------------|")
        for name, secs, ratio in big_rows:
            print(f"| {name:<62} | {secs:6.2f} | {ratio:>13} |")
        ratio = big_rows[1][1] / big_rows[0][1]
        print(f"goal: <= 1.10x bare ffmpeg -> {'PASS' if ratio <= 1.10 else 'MISS'} ({ratio:.2f}x)")
    return 0


if __name__ == "__main__":
    harness.run(main)
