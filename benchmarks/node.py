"""A node's ranks at once: N rank processes save (or stream) their clips at the same moment.

    .venv/bin/python benchmarks/node.py [--ranks 2 4 8] [--frames 48] [--width 640 --height 384]
                                        [--threads 1] [--repeat 3] [--idle-s 3]
                                        [--reference shared|none]
                                        [--json OUT] [--figures DIR]

N rank processes are started and connected before anything is timed, each
holding its own float32 CTHW clip (frames [i*F, (i+1)*F) of benchmarks/encode.py's
clip, so every rank's is different). For each path, all of them are released
together (one event) and the run ends when the last has its file:

  (a) bare ffmpeg         N ffmpegs at once, the encode argv reading each rank's rgb24
                          file in /dev/shm: the encoder's own limit on this host
  (b) imageio             N processes converting their clip whole, imageio.mimsave
  (c) in-process pipe     N processes converting 8-frame chunks into their own ffmpeg's
                          stdin (SGLang's direct save, on the CPU, with the same argv)
  framewire save          save_video to the one worker
  framewire stream        open_video, a write per 8-frame chunk

Beside each save, every rank of (b), (c) and the framewire rows decodes the same
reference clip, as a video-to-video request's ranks do: in (b) and (c) each rank
with an ffmpeg of its own (an engine without the worker), in the framewire rows
through the worker (one ffmpeg run shared by all ranks). (a) decodes nothing: it
is the encoder's own bound. With --reference none no row decodes: the saves alone.

Every encode pins the same x264 thread count (--threads), so every output must
equal its rank's reference (the bare ffmpeg output of its frames, made before
the runs), and each run's reference decode the local decode of it. Figures,
medians of --repeat runs:

  wall           go -> the last rank has its file; and that over (a)'s at the same N
  rank p50/max   go -> each rank has its file
  memory         what the node's processes hold beyond their level at go, sampled
                 every 20 ms: each rank's and the worker's peak private memory, each
                 encoder's peak (VmHWM), and the peak of the shared memory they hold
                 (a rank's copy of its clip, the staging segments, the decoded
                 frames), each segment once (node_ranks.Memory)
  worker CPU     the worker's own CPU time over its ffmpeg children's (x264's)

Then one more run of each path with a prober beside the ranks: a GET /healthz on
the Unix socket and a tiny encode (2 frames 64x48, through its own Client), each
issued every ~50 ms; their p99 is reported against their latency on the idle
worker. The probes run only there, so the other figures do not carry their cost.
Goals in benchmarks/README.md. Beside the table it draws node.png.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
import numpy as np  # noqa: E402
import plots  # noqa: E402
from encode import write_clip  # noqa: E402
from node_ranks import DECODING, WORKER_PATHS, Memory, local_decode, prober, rank  # noqa: E402
from routes import bare, cpu_s  # noqa: E402

PATHS = {"bare": "(a) bare ffmpeg", "imageio": "(b) imageio", "pipe": "(c) in-process pipe",
         "save": "framewire save", "stream": "framewire stream"}  # fmt: skip
GOAL_WALL, GOAL_HEALTH_MS, GOAL_TINY = 1.05, 20.0, 2.0
REFERENCE = {"fps": 24, "width": 320, "height": 192, "step_s": 0.02, "seconds": 2.0}
IDLE_S = 3.0
MIB = 1024  # KiB


class Node:
    """The worker, the prober and the ranks of one rank count, and how one run goes."""

    def __init__(self, worker: Any, spec: dict[str, Any], refs: list[str]):
        self.worker, self.spec, self.refs = worker, spec, refs
        self.ctx = harness.rank_context("torch", "framewire.client")
        self.go = self.ctx.Event()
        self.ranks: list[tuple[Any, Any]] = []
        self.probe, mine = self.ctx.Pipe()
        self.prober = self.ctx.Process(target=prober, args=(spec, mine), daemon=True)
        self.prober.start()
        assert self.probe.recv() == "started"
        self.runs = 0

    def probed(self, seconds: float) -> dict[str, list[float]]:
        self.probe.send("start")
        time.sleep(seconds)
        self.probe.send("stop")
        return self.probe.recv()

    def start_ranks(self, n: int) -> None:
        for i in range(n):
            conn, theirs = self.ctx.Pipe()
            proc = self.ctx.Process(target=rank, args=(i, self.spec, theirs, self.go), daemon=True)
            proc.start()
            self.ranks.append((proc, conn))
        for _, conn in self.ranks:
            assert conn.recv() == "started"

    def stop_ranks(self) -> None:
        for proc, conn in self.ranks:
            conn.send(None)
            proc.join(30)
        self.ranks = []

    def close(self) -> None:
        self.stop_ranks()
        self.probe.send(None)
        self.prober.join(30)

    def run(self, path: str, probed: bool) -> dict[str, Any]:
        self.runs += 1
        expected = ""
        if path in DECODING and self.spec["reference"] is not None:
            expected = local_decode(self.spec["reference"], self.runs)
        for _, conn in self.ranks:
            conn.send((path, self.runs))
        for _, conn in self.ranks:
            assert conn.recv() == "ready"
        w = self.worker.pid
        own0, kids0 = cpu_s(w)
        memory = Memory([proc.pid for proc, _ in self.ranks], w)
        memory.start()
        if probed:
            self.probe.send("start")
        started = time.monotonic()
        self.go.set()
        done = [conn.recv() for _, conn in self.ranks]
        self.go.clear()
        probes = None
        if probed:
            self.probe.send("stop")
            probes = self.probe.recv()
        held = memory.stop()
        own1, kids1 = cpu_s(w)
        ours = path in WORKER_PATHS
        if not ours:
            held["worker"] = 0  # idle, or serving the prober alone
        latencies = [d["done"] - started for d in done]
        same = all(d["sha256"] == ref for d, ref in zip(done, self.refs, strict=False))
        same &= all(d["decoded"] == expected for d in done)
        return {
            "ranks": len(done), "path": path, "probed": probed, "wall_s": max(latencies),
            "latencies_s": latencies, "memory_mib": sum(held.values()) / MIB,
            "memory_parts_mib": {k: v / MIB for k, v in held.items()},
            "worker_cpu": (own1 - own0) / (kids1 - kids0) if ours and kids1 > kids0 else None,
            "probes": probes, "same": same, "decodes": sum(1 for d in done if d["decoded"]),
        }  # fmt: skip


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else float("nan")


def summarize(runs: list[dict[str, Any]], idle: dict[str, list[float]]) -> list[dict[str, Any]]:
    rows = []
    for n in sorted({r["ranks"] for r in runs}):
        base = statistics.median(
            r["wall_s"] for r in runs if r["ranks"] == n and r["path"] == "bare" and not r["probed"]
        )
        for path, label in PATHS.items():
            mine = [r for r in runs if r["ranks"] == n and r["path"] == path]
            timed = [r for r in mine if not r["probed"]]
            probes = next(r["probes"] for r in mine if r["probed"])
            wall = statistics.median(r["wall_s"] for r in timed)
            cpu = [r["worker_cpu"] for r in timed if r["worker_cpu"] is not None]
            rows.append({
                "ranks": n, "path": label, "wall_s": wall, "x_a": wall / base,
                "walls_s": [r["wall_s"] for r in timed],
                "rank_p50_s": statistics.median(statistics.median(r["latencies_s"]) for r in timed),
                "rank_max_s": statistics.median(max(r["latencies_s"]) for r in timed),
                "memory_mib": statistics.median(r["memory_mib"] for r in timed),
                "worker_cpu": statistics.median(cpu) if cpu else None,
                "health_p99_ms": p99(probes["health_ms"]), "tiny_p99_ms": p99(probes["tiny_ms"]),
                "tiny_x_idle": p99(probes["tiny_ms"]) / statistics.median(idle["tiny_ms"]),
                "same": all(r["same"] for r in mine),
            })  # fmt: skip
    return rows


def report(rows: list[dict[str, Any]], idle: dict[str, list[float]]) -> list[str]:
    print("| ranks | path | wall | / (a) | rank p50 | rank max | memory, node | worker CPU "
          "/ x264 | health p99 | tiny encode p99 | same bytes |")  # fmt: skip
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |")
    for r in rows:
        cpu = "—" if r["worker_cpu"] is None else f"{r['worker_cpu']:.3f}"
        print(f"| {r['ranks']} | {r['path']} | {r['wall_s']:.2f} s | {r['x_a']:.2f}x | "
              f"{r['rank_p50_s']:.2f} s | {r['rank_max_s']:.2f} s | {r['memory_mib']:.0f} MiB | "
              f"{cpu} | {r['health_p99_ms']:.1f} ms | {r['tiny_p99_ms']:.0f} ms "
              f"({r['tiny_x_idle']:.1f}x idle) | {'yes' if r['same'] else 'NO'} |")  # fmt: skip
    h, t = statistics.median(idle["health_ms"]), statistics.median(idle["tiny_ms"])
    print(f"idle worker: health p50 {h:.1f} ms, p99 {p99(idle['health_ms']):.1f} ms; "
          f"tiny encode p50 {t:.0f} ms, p99 {p99(idle['tiny_ms']):.0f} ms")  # fmt: skip
    verdicts = []
    for label in (PATHS["save"], PATHS["stream"]):
        ours = [r for r in rows if r["path"] == label]
        others = {r["ranks"]: r for r in rows if r["path"] in (PATHS["imageio"], PATHS["pipe"])}
        ahead = all(
            o["wall_s"] > r["wall_s"] and o["memory_mib"] > r["memory_mib"]
            for r in ours for o in rows
            if o["ranks"] == r["ranks"] and o["path"] in (PATHS["imageio"], PATHS["pipe"])
        ) and bool(others)  # fmt: skip
        worst = max(r["x_a"] for r in ours)
        health = max(r["health_p99_ms"] for r in ours)
        tiny = max(r["tiny_x_idle"] for r in ours)
        verdicts += [
            f"{label}: wall <= {GOAL_WALL}x (a) at every N: worst {worst:.2f}x -> "
            f"{'PASS' if worst <= GOAL_WALL else 'MISS'}",
            f"{label}: ahead of (b) and (c) in wall and memory at every N -> "
            f"{'PASS' if ahead else 'MISS'}",
            f"{label}: health p99 <= {GOAL_HEALTH_MS:.0f} ms: worst {health:.1f} ms -> "
            f"{'PASS' if health <= GOAL_HEALTH_MS else 'MISS'}",
            f"{label}: tiny encode p99 <= {GOAL_TINY:.0f}x idle: worst {tiny:.1f}x -> "
            f"{'PASS' if tiny <= GOAL_TINY else 'MISS'}",
        ]
    print("\n".join(verdicts))
    return verdicts


def plot(rows: list[dict[str, Any]], directory: Path, note: str) -> None:
    title = "A node's ranks at once, through one worker and without it"
    with plots.figure(directory / "node.png", title, panels=3, note=note) as axes:
        plots.pivot_bars(axes[0], rows, "ranks", "path", "x_a",
                         ylabel="total wall / (a) bare ffmpeg", xlabel="ranks")  # fmt: skip
        plots.reference(axes[0], GOAL_WALL, f"goal: {GOAL_WALL}x")
        plots.pivot_bars(axes[1], rows, "ranks", "path", "memory_mib",
                         ylabel="peak memory, node's processes (MiB, log)", xlabel="ranks",
                         log_y=True)  # fmt: skip
        plots.pivot_bars(axes[2], rows, "ranks", "path", "tiny_x_idle",
                         ylabel="tiny encode p99 / its idle p50", xlabel="ranks")  # fmt: skip
        plots.reference(axes[2], GOAL_TINY, f"goal: {GOAL_TINY:.0f}x")


def main() -> int:
    parser = harness.parser(__doc__, frames=48, width=640, height=384, repeat=3)
    parser.add_argument("--ranks", type=harness.count, nargs="+", default=[2, 4, 8])
    parser.add_argument("--chunk", type=harness.count, default=8)
    parser.add_argument("--threads", type=harness.count, default=1, help="x264's, for all")
    parser.add_argument("--idle-s", type=float, default=IDLE_S, help="probes of the idle worker")
    parser.add_argument(
        "--reference",
        choices=("shared", "none"),
        default="shared",
        help="none: the framewire rows save alone, the same work as the others",
    )
    plots.add_option(parser)
    args = parser.parse_args()
    from framewire.core.media.process import resolve_ffmpeg

    from tests.support.refclips import make_video
    from tests.support.worker import start_worker

    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="framewire-bench-node-", dir="/dev/shm"))
    root = Path(tempfile.mkdtemp(prefix="framewire-node-"))
    worker = start_worker(root, "--log-level", "warning")
    node = None
    try:
        count = max(args.ranks)
        segments = [work / f"clip-{i}.f32" for i in range(count)]
        rgbs = [work / f"clip-{i}.rgb" for i in range(count)]
        for i in range(count):
            write_clip(segments[i], rgbs[i], args.frames, args.height, args.width, args.frames * i)
        refs = [bare(rgbs[i], work / "ref.mp4", args.width, args.height, args.threads)["sha256"]
                for i in range(count)]  # fmt: skip
        video = make_video(worker.inputs / "ref.mp4",
                           f"testsrc2=size={REFERENCE['width']}x{REFERENCE['height']}:rate=24",
                           REFERENCE["seconds"])  # fmt: skip
        resolve_ffmpeg()
        spec = {
            "frames": args.frames, "height": args.height, "width": args.width,
            "chunk": args.chunk, "threads": args.threads, "url": worker.uds_url,
            "uds": str(worker.uds), "fd_socket": str(worker.fd_socket),
            "outputs": str(worker.outputs), "segments": [str(s) for s in segments],
            "rgbs": [str(r) for r in rgbs],
            "reference": REFERENCE | {"path": str(video)} if args.reference == "shared" else None,
        }  # fmt: skip
        node = Node(worker, spec, refs)
        idle = node.probed(args.idle_s)
        runs: list[dict[str, Any]] = []
        for n in args.ranks:
            node.start_ranks(n)
            for i in range(args.repeat + 1):  # the last one with the probes
                for path in PATHS:
                    print(f"{n} ranks: {path} ({i + 1}/{args.repeat + 1})", file=sys.stderr)
                    runs.append(node.run(path, probed=i == args.repeat))
            node.stop_ranks()
    finally:
        if node is not None:
            node.close()
        worker.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    rows = summarize(runs, idle)
    setup = (f"{args.frames} frames {args.width}x{args.height} float32 per rank, x264 fast "
             f"-threads {args.threads} for all; {len(os.sched_getaffinity(0))} CPUs (worker CPU "
             f"slots as many), reference decode: {args.reference}; load average "
             f"{os.getloadavg()[0]:.2f} at the end; "
             f"median of {args.repeat}")  # fmt: skip
    print(f"\n{setup}; {time.monotonic() - started:.0f} s in all")
    verdicts = report(rows, idle)
    harness.write_json(args.json, {"rows": rows, "runs": runs, "idle": idle,
                                   "verdicts": verdicts, "setup": setup})  # fmt: skip
    plot(rows, args.figures, setup)
    same = all(r["same"] for r in rows)
    print(f"every output equal to its rank's reference, every decode to the local one: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    harness.run(main)
