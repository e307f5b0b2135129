"""Several outputs of one request: serial against parallel, through one worker.

    .venv/bin/python benchmarks/parallel.py [--outputs 1 2 4] [--frames 120] [--threads N]

One 1344x768 float32 clip sits in a POSIX shm segment; each output encodes it.
"serial" sends one request per output, one after another; "parallel" sends one
request with every output, and the worker's scheduler runs them side by side as
far as its CPU slots (the affinity set) allow. Every encode pins the same x264
thread count (default: half the CPUs, so two encodes fit), so both ways produce
the same bytes. Goal (benchmarks/README.md): 2 outputs <= 0.6x serial wall on a host with
>= 8 free cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from encode import write_clip  # noqa: E402

from tests.support.worker import start_worker  # noqa: E402

HEIGHT, WIDTH = 768, 1344


def output(key: str, frames: int, size: int, path: str, threads: int) -> dict:
    source = {"kind": "shm", "key": key, "byte_size": size, "dtype": "float32",
              "shape": [3, frames, HEIGHT, WIDTH]}  # fmt: skip
    return {"source": source, "path": path, "fps": 24, "threads": threads}


def encode(h: httpx.Client, outputs: list[dict]) -> list[dict]:
    r = h.post("http://framewire/v1/videos:encode", json={"outputs": outputs})
    r.raise_for_status()
    return r.json()["outputs"]


def main() -> int:
    cpus = len(os.sched_getaffinity(0))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--outputs", type=harness.count, nargs="+", default=[1, 2, 4])
    parser.add_argument("--frames", type=harness.count, default=120)
    parser.add_argument("--threads", type=harness.count, default=max(1, cpus // 2))
    args = parser.parse_args()
    key = f"/framewire-bench-parallel-{os.getpid()}"
    segment, rgb = Path(f"/dev/shm{key}"), Path(f"/dev/shm{key.lstrip('/')}.rgb")
    rows = []
    with tempfile.TemporaryDirectory(prefix="framewire-parallel-") as tmp:
        worker = start_worker(Path(tmp), "--cpu-slots", str(cpus))
        try:
            write_clip(segment, rgb, args.frames, HEIGHT, WIDTH)
            rgb.unlink()
            size = segment.stat().st_size
            transport = httpx.HTTPTransport(uds=str(worker.uds))
            with httpx.Client(transport=transport, timeout=3600) as h:
                for n in args.outputs:
                    outs = [output(key, args.frames, size, f"s{n}-{i}.mp4", args.threads)
                            for i in range(n)]  # fmt: skip
                    t0 = time.perf_counter()
                    serial = [encode(h, [o])[0] for o in outs]
                    t_serial = time.perf_counter() - t0
                    outs = [o | {"path": f"p{n}-{i}.mp4"} for i, o in enumerate(outs)]
                    t0 = time.perf_counter()
                    parallel = encode(h, outs)
                    t_parallel = time.perf_counter() - t0
                    same = {r["sha256"] for r in serial + parallel} == {serial[0]["sha256"]}
                    waited = max(r["timings"]["queue_ms"] for r in parallel) / 1e3
                    rows.append((n, t_serial, t_parallel, waited, same))
                    print(f"{n} outputs done", file=sys.stderr)
        finally:
            worker.stop()
            segment.unlink(missing_ok=True)
            rgb.unlink(missing_ok=True)
    print(f"\n1344x768 float32, {args.frames} frames each, -threads {args.threads} per encode, "
          f"{cpus} CPUs (worker CPU slots {cpus})")  # fmt: skip
    print("| outputs | serial s | parallel s | parallel / serial | max queue wait s | same bytes |")
    print("|---------|----------|------------|-------------------|------------------|------------|")
    for n, ts, tp, w, same in rows:
        print(f"| {n:7d} | {ts:8.2f} | {tp:10.2f} | {tp / ts:16.2f}x | {w:16.2f} | "
              f"{'yes' if same else 'NO':>10} |")  # fmt: skip
    two = [r for r in rows if r[0] == 2]
    if two:
        ratio = two[0][2] / two[0][1]
        verdict = "PASS" if ratio <= 0.6 else "MISS"
        goal = "goal: 2 outputs <= 0.6x serial on >= 8 free cores"
        print(f"{goal} -> {verdict} ({ratio:.2f}x on {cpus} CPUs)")
    return 0 if all(r[4] for r in rows) else 1


if __name__ == "__main__":
    harness.run(main)
