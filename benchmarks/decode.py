"""Reference-decode benchmark: N ranks through one worker against N independent ffmpeg decodes.

    .venv/bin/python benchmarks/decode.py [--ranks 8] [--seconds 5] [--source 1920x1080]
                                          [--size 1344x768] [--json OUT] [--figures DIR]

A 1920x1080 30 fps source (testsrc2 with temporal noise, libx264; --source) is made once
in a temp dir. Every rank decodes it to 1344x768 (--size) at 24 fps with the
reference-decode argv (docs/byte-exactness.md):

  one decode      one process, ffmpeg's rgb24 read from its stdout (the yardstick:
                  what every rank does today)
  one, memfd      one process, the client's local fallback: the same argv writing
                  into a memfd (no pipe), for reference
  N x ffmpeg      N processes doing the same at once, each keeping its own copy
  N x framewire   N processes asking one worker: one ffmpeg run, one sealed memfd
  ... cached      the same again, answered from the worker's cache

Rank processes (forks of one server that imported the client: harness.rank_context)
start and report ready before the clock starts; all are
released together, and the wall time runs until the last one has its frames
with every page touched. Memory is the sum over ranks of the growth of their
proportional set size (Pss, /proc/PID/smaps_rollup), measured while all of them
still hold their frames: shared pages count once in total, not once per rank.
Every rank's frames are hashed; all variants must give the same bytes.
The goals are in benchmarks/README.md. Beside the table it draws each variant's
wall time and memory (decode.png).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests.support: the worker

import harness  # noqa: E402
import numpy as np  # noqa: E402
import plots  # noqa: E402

from tests.support.stepped import stepped  # noqa: E402

FPS = 24
GOAL_WALL, GOAL_MEMORY = 1.2, 1.1
MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


# ----------------------------------------------------------------------------- a rank


def pss_bytes() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no Pss in smaps_rollup")


def rank(mode: str, video: str, size: tuple[int, int], fd_socket: str, conn: Connection) -> None:
    """One rank, stepped by the parent over ``conn``: started, go, measure, exit."""
    from framewire.client import Client
    from framewire.core.media.argv import decode_argv
    from framewire.core.media.process import find_ffmpeg
    from framewire.core.wire import DecodeRequest

    ffmpeg = find_ffmpeg()
    client = Client(fd_socket=fd_socket)
    width, height = size
    before = pss_bytes()
    conn.send("started")
    assert conn.recv() == "go"
    ref = None
    if mode == "ffmpeg":
        # What a rank does without framewire: its own ffmpeg, its own copy.
        request = DecodeRequest(path=video, fps=FPS, width=width, height=height)
        argv = decode_argv(ffmpeg, request, guard=False)
        out = subprocess.run(argv, capture_output=True, check=True).stdout
        frames = np.frombuffer(out, np.uint8).reshape(-1, height, width, 3)
        source = "ffmpeg"
    elif mode == "local":
        ref = client.decode_reference(video, fps=FPS, width=width, height=height)
        frames, source = ref.frames, ref.source
    else:
        ref = client.decode_reference(
            video, fps=FPS, width=width, height=height, local_fallback=False
        )
        frames, source = ref.frames, ref.source
    flat = frames.reshape(-1)
    int(flat[::PAGE].sum())  # touch every page, as a consumer would
    done = time.monotonic()
    digest = hashlib.sha256(flat).hexdigest()
    conn.send({"done": done, "sha256": digest, "bytes": flat.size, "source": source})
    assert conn.recv() == "measure"
    conn.send({"pss_growth": pss_bytes() - before})
    assert conn.recv() == "exit"
    if ref is not None:
        ref.close()
    client.close()


# ----------------------------------------------------------------------------- the parent


def run_ranks(
    ctx: BaseContext, n: int, mode: str, video: Path, size: tuple[int, int], fd_socket: Path
) -> dict[str, Any]:
    with stepped(ctx, n, rank, (mode, str(video), size, str(fd_socket))) as ranks:
        started = time.monotonic()
        ranks.tell("go")
        answers = ranks.hear()
        ranks.tell("measure")
        growth = [answer["pss_growth"] for answer in ranks.hear()]
        ranks.tell("exit")
    return {
        "wall_s": max(a["done"] for a in answers) - started,
        "memory_bytes": sum(growth),
        "sha256": sorted({a["sha256"] for a in answers}),
        "bytes": answers[0]["bytes"],
        "sources": sorted({a["source"] for a in answers}),
    }


def make_source(path: Path, seconds: float, size: tuple[int, int], ffmpeg: str) -> None:
    subprocess.run(
        [ffmpeg, "-v", "error", "-y", "-f", "lavfi",
         "-i", f"testsrc2=size={size[0]}x{size[1]}:rate=30,noise=alls=12:allf=t",
         "-t", str(seconds), "-c:v", "libx264", "-preset", "veryfast", "-crf", "20",
         "-pix_fmt", "yuv420p", str(path)],
        check=True,
    )  # fmt: skip


def plot(results: dict[str, dict[str, Any]], directory: Path, note: str) -> None:
    one = results["one decode"]
    names = list(results)
    groups = [name.replace(", ", ",\n").replace(" x ", " x\n") for name in names]
    walls = [results[n]["wall_s"] for n in names]
    memory = [results[n]["memory_bytes"] / MIB for n in names]
    copy_mib = one["bytes"] / MIB
    title = "Reference decode: one rank against N ranks, with and without the worker"
    with plots.figure(directory / "decode.png", title, panels=2, note=note) as (left, right):
        plots.bars(left, groups, {"wall": walls}, ylabel="wall time (s)")
        plots.reference(left, GOAL_WALL * one["wall_s"], f"goal: <= {GOAL_WALL}x one decode")
        plots.bars(right, groups, {"memory": memory}, ylabel="memory of all ranks (MiB, Pss)")
        plots.reference(right, copy_mib, f"one copy ({copy_mib:.0f} MiB)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=harness.count, default=8)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--source", type=harness.size, default=(1920, 1080), help="WxH")
    parser.add_argument("--size", type=harness.size, default=(1344, 768), help="decoded, WxH")
    parser.add_argument("--json", type=Path, default=None)
    plots.add_option(parser)
    args = parser.parse_args()

    from framewire.core.media.process import find_ffmpeg

    from tests.support.worker import Worker, start_worker

    ffmpeg = find_ffmpeg()
    size = args.size
    width, height = size
    source = "{}x{}".format(*args.source)
    root = Path(tempfile.mkdtemp(prefix="framewire-bench-decode-"))
    worker: Worker | None = None
    try:
        video = root / "inputs" / "source.mp4"  # the worker's input root (start_worker)
        video.parent.mkdir()
        t0 = time.monotonic()
        make_source(video, args.seconds, args.source, ffmpeg)
        print(f"source: {args.seconds:g} s of {source} at 30 fps, "
              f"{video.stat().st_size / MIB:.1f} MiB, made in {time.monotonic() - t0:.1f} s; "
              f"decoding to {width}x{height} at {FPS} fps, {args.ranks} ranks, "
              f"{len(os.sched_getaffinity(0))} CPUs")  # fmt: skip
        n = args.ranks
        fd_socket = root / "fd.sock"
        ctx = harness.rank_context("framewire.client", "framewire.core.media.argv")
        results: dict[str, dict[str, Any]] = {}
        run_ranks(ctx, 1, "ffmpeg", video, size, fd_socket)  # warm the page cache and the binary
        results["one decode"] = run_ranks(ctx, 1, "ffmpeg", video, size, fd_socket)
        results["one, memfd"] = run_ranks(ctx, 1, "local", video, size, root / "no-worker.sock")
        results[f"{n} x ffmpeg"] = run_ranks(ctx, n, "ffmpeg", video, size, fd_socket)
        worker = start_worker(root)
        results[f"{n} x framewire"] = run_ranks(ctx, n, "worker", video, size, fd_socket)
        results[f"{n} x framewire, cached"] = run_ranks(ctx, n, "worker", video, size, fd_socket)
    finally:
        if worker is not None:
            worker.stop()
        shutil.rmtree(root, ignore_errors=True)

    one = results["one decode"]
    copy = one["bytes"]
    digests = {d for r in results.values() for d in r["sha256"]}
    print(f"one copy: {copy / MIB:.1f} MiB ({copy // (width * height * 3)} frames); "
          f"one decode: {one['wall_s']:.2f} s; "
          f"bytes identical across all ranks and variants: {len(digests) == 1}")  # fmt: skip
    print()
    print(f"| {'variant':<24} | {'wall s':>7} | {'x one decode':>12} | "
          f"{'memory MiB':>10} | {'x one copy':>10} |")  # fmt: skip
    print(f"|{'-' * 26}|{'-' * 9}|{'-' * 14}|{'-' * 12}|{'-' * 12}|")
    for name, r in results.items():
        print(f"| {name:<24} | {r['wall_s']:7.2f} | {r['wall_s'] / one['wall_s']:12.2f} | "
              f"{r['memory_bytes'] / MIB:10.1f} | {r['memory_bytes'] / copy:10.2f} |")  # fmt: skip
    fw = results[f"{n} x framewire"]
    wall_ok = fw["wall_s"] / one["wall_s"] <= GOAL_WALL
    mem_ok = fw["memory_bytes"] / copy <= GOAL_MEMORY
    print()
    print(f"goals ({n} x framewire, cold): wall <= {GOAL_WALL}x one decode: "
          f"{'met' if wall_ok else 'MISSED'}; memory <= {GOAL_MEMORY}x one copy: "
          f"{'met' if mem_ok else 'MISSED'}")  # fmt: skip
    harness.write_json(args.json, results)
    note = (f"{args.seconds:g} s of {source} 30 fps decoded to {width}x{height} at {FPS} fps "
            f"({copy // (width * height * 3)} frames), {n} ranks")  # fmt: skip
    plot(results, args.figures, note)
    return 0 if len(digests) == 1 else 1


if __name__ == "__main__":
    harness.run(main)
