"""Encodes beside the ranks: what N saves cost a node's rank-like CPU work, through the
worker (its encodes yield) and in the ranks' own processes (the engine's save path).

    .venv/bin/python benchmarks/ranks.py [--encodes 2] [--frames 48] [--width 320]
        [--height 192] [--ranks N] [--step-ms 20] [--repeat 3] [--alone-s 4] [--probe-s 3]
        [--settings NAME ...] [--placement session|service|container]
        [--json OUT]

One rank per CPU of this process's affinity set (or --ranks N): a process looping over
a fixed step of torch CPU work (one thread, a chain of 256x256 matmuls sized to
``--step-ms`` alone), timing every step. They run for the whole benchmark; each figure
is over a window:

  alone          the ranks and nothing else, 4 s before each of the windows below
  yield          N save_video at once through a worker at its defaults (encodes niced,
                 SCHED_BATCH): go -> the last file
  idle policy    the same through a worker with --encode-sched idle
  no yield       the same through a worker with --encode-nice 0 --encode-sched normal
                 (what every encode ran at before)
  in-process     N processes converting their clip and calling imageio.mimsave (the
                 engine's own save: ffmpeg at the ranks' priority)

``--placement``: where the workers run. ``session`` (the default): in this process's
session, the ranks' own; ``service``: each in a session of its own, as a service
manager starts one (with autogroup on, a session is a scheduling group of its own,
weighed against the ranks' by its niceness alone); ``container``: each in a container
as compose.yaml runs the worker, and the ranks in another container (podman, root;
benchmarks/containers.py builds the image once).

Per window: the ranks' mean and p95 step time, the mean over alone's (the ranks' lost
throughput), and the N encodes' wall, over their wall without ranks (the same N saves
through the same worker before the ranks start). Then, per worker setting, one more run
with benchmarks/node_ranks.py's prober beside it (a /healthz and a tiny encode every
~50 ms; run apart because a tiny encode's ffmpeg start costs the ranks' CPU too): their
p99, against the prober on the idle host and beside the ranks alone. Medians of
--repeat; every file's sha256 equal to the in-process save's (one argv, threads pinned).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from encode import FPS, clip_chunk, imageio_save  # noqa: E402
from node_ranks import prober, sha256_of  # noqa: E402
from rank_loop import calibrate, rank  # noqa: E402

SETTINGS = {
    "yield": (),
    "idle policy": ("--encode-sched", "idle"),
    "no yield": ("--encode-nice", "0", "--encode-sched", "normal"),
}
PLACEMENTS = {
    "session": "the ranks' session",
    "service": "a session of their own",
    "container": "a container of their own, the ranks in another (podman, compose.yaml's)",
}
ALONE_S, PROBE_IDLE_S, RUN_TIMEOUT_S = 4.0, 3.0, 900.0
GOAL_STEP, GOAL_TINY, GOAL_HEALTH_MS = 1.05, 2.0, 20.0


def saver(index: int, spec: dict[str, Any], conn: Connection) -> None:
    """One save per order: ``("worker", url)`` through that worker, ``("imageio", None)``
    in this process. Answers (monotonic end, sha256)."""
    import torch
    from framewire.client import Client

    torch.set_num_threads(1)
    clip = clip_chunk(index * spec["frames"], (index + 1) * spec["frames"], spec["height"],
                      spec["width"])  # fmt: skip
    clients: dict[str, Client] = {}
    conn.send("started")
    while (order := conn.recv()) is not None:
        how, url, fd_socket, outputs = order
        name = f"s{index}.mp4"
        if how == "imageio":
            out = Path(outputs) / name
            imageio_save(torch.from_numpy(clip), out, spec["threads"])
            digest = sha256_of(out)
        else:
            if url not in clients:
                clients[url] = Client(url, fd_socket=fd_socket, local_fallback=False,
                                      timeout=RUN_TIMEOUT_S)  # fmt: skip
            result = clients[url].save_video(clip, name, fps=FPS, threads=spec["threads"])
            assert result.sha256 is not None, result
            digest = result.sha256
            (Path(outputs) / name).unlink()
        conn.send((time.monotonic(), digest))
    for client in clients.values():
        client.close()


class Savers:
    """N saver processes, started (and their imports paid) before anything is timed."""

    def __init__(self, ctx: Any, n: int, spec: dict[str, Any]):
        self.conns = []
        self.procs = []
        for i in range(n):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=saver, args=(i, spec, theirs), daemon=True)
            proc.start()
            self.conns.append(mine)
            self.procs.append(proc)
        for conn in self.conns:
            assert conn.recv() == "started"

    def run(self, how: str, worker: Any | None, outputs: str) -> dict[str, Any]:
        url = worker.uds_url if worker is not None else None
        # As this host sees it: a container's worker names its own path in /v1/info.
        fd_socket = str(worker.fd_socket) if worker is not None else None
        go = time.monotonic()
        for conn in self.conns:
            conn.send((how, url, fd_socket, outputs))
        done = []
        for conn in self.conns:
            if not conn.poll(RUN_TIMEOUT_S):
                raise TimeoutError(f"a save took over {RUN_TIMEOUT_S:g} s")
            done.append(conn.recv())
        end = max(t for t, _ in done)
        return {"go": go, "end": end, "wall_s": end - go, "sha256": [d for _, d in done]}

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(30)


def probed(ctx: Any, worker: Any, during: Any, idle_s: float) -> dict[str, list[float]]:
    """The prober's latencies while ``during()`` runs (for ``idle_s`` when None)."""
    spec = {"uds": str(worker.uds), "url": worker.uds_url, "fd_socket": str(worker.fd_socket),
            "outputs": str(worker.outputs)}  # fmt: skip
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=prober, args=(spec, theirs), daemon=True)
    proc.start()
    try:
        assert mine.recv() == "started"
        mine.send("start")
        if during is None:
            time.sleep(idle_s)
        else:
            during()
        mine.send("stop")
        got: dict[str, list[float]] = mine.recv()
        mine.send(None)
        return got
    finally:
        proc.join(30)


def start_ranks(ctx: Any, n: int, k: int) -> Any:
    """``n`` rank processes of ``k`` matmuls a step, started and stepping; a function that
    stops them and returns each rank's (ends, seconds)."""
    conns = []
    for _ in range(n):
        mine, theirs = ctx.Pipe()
        ctx.Process(target=rank, args=(k, theirs), daemon=True).start()
        conns.append(mine)
    for conn in conns:
        assert conn.recv() == "started"

    def stop() -> list[Any]:
        for conn in conns:
            conn.send("stop")
        return [conn.recv() for conn in conns]

    return stop


def window(ranks: list[tuple[list[float], list[float]]], t0: float, t1: float) -> list[float]:
    """Every rank's step times (ms) that ended within [t0, t1]."""
    return [d * 1e3 for ends, took in ranks
            for e, d in zip(ends, took, strict=True) if t0 <= e <= t1]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--encodes", type=harness.count, default=2)
    ap.add_argument("--frames", type=harness.count, default=48)
    ap.add_argument("--width", type=harness.count, default=320)
    ap.add_argument("--height", type=harness.count, default=192)
    ap.add_argument("--ranks", type=harness.count, help="rank processes (default: one per CPU)")
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--repeat", type=harness.count, default=3)
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    ap.add_argument("--alone-s", type=float, default=ALONE_S, help="each window of the ranks alone")
    ap.add_argument("--probe-s", type=float, default=PROBE_IDLE_S,
                    help="each probe without saves (idle host, ranks alone)")  # fmt: skip
    ap.add_argument(
        "--placement", choices=tuple(PLACEMENTS), default="session", help="where the workers run"
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from framewire.core.media.argv import x264_auto_threads

    from tests.support.worker import start_worker

    n_ranks = args.ranks or len(os.sched_getaffinity(0))
    k = calibrate(args.step_ms)
    ctx = harness.rank_context("torch", "framewire.client")
    spec = {"frames": args.frames, "width": args.width, "height": args.height,
            "threads": x264_auto_threads(args.height)}  # fmt: skip
    windows: list[dict[str, Any]] = []
    probes: dict[str, list[dict[str, list[float]]]] = {}
    containers = None
    if args.placement == "container":
        from containers import WORKER_UID, Containers, cpu_weight

        containers = Containers()
        os.environ["FRAMEWIRE_WORKER_UID"] = str(WORKER_UID)  # the savers' and prober's clients
    applied: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workers: dict[str, Any] = {}
        for name, flags in SETTINGS.items():
            if name not in args.settings:
                continue
            root = Path(tmp) / name.replace(" ", "-")
            if containers is not None:
                env = dict(zip(["FRAMEWIRE_" + f[2:].replace("-", "_").upper()
                                for f in flags[::2]], flags[1::2], strict=True))  # fmt: skip
                workers[name] = containers.worker(f"framewire-bench-{root.name}", root, env)
                applied[name] = cpu_weight(containers.podman, workers[name].name)
            else:
                new_session = args.placement == "service"
                workers[name] = start_worker(root, *flags, yielding=True, new_session=new_session)
        first = next(iter(workers.values()))  # where the probes without saves go
        outputs = str(first.outputs)
        savers = Savers(ctx, args.encodes, spec)
        try:
            for w in workers.values():  # untimed: the first save's set-up and kernels
                savers.run("worker", w, str(w.outputs))
            savers.run("imageio", None, outputs)
            probes["idle host"] = [probed(ctx, first, None, args.probe_s)]
            bare = {name: [savers.run("worker", w, str(w.outputs))["wall_s"]
                           for _ in range(args.repeat)] for name, w in workers.items()}  # fmt: skip
            bare["in-process"] = [savers.run("imageio", None, outputs)["wall_s"]
                                  for _ in range(args.repeat)]  # fmt: skip
            if containers is not None:
                stop_ranks = containers.ranks(n_ranks, k, Path(tmp))
            else:
                stop_ranks = start_ranks(ctx, n_ranks, k)
            time.sleep(2.0)  # the ranks' first steps: imports, caches
            for i in range(args.repeat):
                for name, w in [*workers.items(), ("in-process", None)]:
                    t = time.monotonic()  # the ranks alone just before each: the baseline
                    time.sleep(args.alone_s)
                    windows.append({"name": "alone", "go": t, "end": time.monotonic(),
                                    "sha256": []})  # fmt: skip
                    how = "worker" if w is not None else "imageio"
                    where = str(w.outputs) if w is not None else outputs
                    windows.append({"name": name} | savers.run(how, w, where))
                print(f"round {i + 1} of {args.repeat} done", file=sys.stderr)
            probes["ranks alone"] = [probed(ctx, first, None, args.probe_s)]
            for name, w in workers.items():
                saves = lambda w=w: savers.run("worker", w, str(w.outputs))  # noqa: E731
                probes[name] = [probed(ctx, w, saves, args.probe_s)]
            ranks = stop_ranks()
        finally:
            try:
                savers.close()
            finally:
                for w in workers.values():
                    w.stop()
                if containers is not None:
                    containers.close()
    if applied:
        print("the workers' containers' CPU weight, as applied: "
              + ", ".join(f"{n} {v}" for n, v in applied.items()), file=sys.stderr)  # fmt: skip
    rows = summarize(windows, ranks, bare)
    same = len({d for w in windows for d in w["sha256"]}) == args.encodes
    report(args, n_ranks, k, rows, probes, same)
    harness.write_json(args.json, {"rows": rows, "probes": probes, "sha256_equal": same,
                                   "ranks": n_ranks, "matmuls_per_step": k})  # fmt: skip
    return 0 if same else 1


def summarize(
    windows: list[dict[str, Any]], ranks: list, bare: dict[str, list[float]]
) -> list[dict[str, Any]]:
    """One row per window name: medians over its runs."""
    rows = []
    for name in dict.fromkeys(w["name"] for w in windows):
        runs = [w for w in windows if w["name"] == name]
        steps = [window(ranks, w["go"], w["end"]) for w in runs]
        row: dict[str, Any] = {
            "name": name,
            "step_mean_ms": statistics.median(statistics.fmean(s) for s in steps),
            "step_p95_ms": statistics.median(harness.pct(s, 0.95) for s in steps),
            "step_means_ms": [statistics.fmean(s) for s in steps],
            "steps": [len(s) for s in steps],
        }
        if name != "alone":
            row["wall_s"] = statistics.median(w["wall_s"] for w in runs)
            row["bare_wall_s"] = statistics.median(bare[name])
            row["walls_s"] = [w["wall_s"] for w in runs]
        rows.append(row)
    return rows


def report(args: argparse.Namespace, n_ranks: int, k: int, rows: list[dict],
           probes: dict[str, list[dict[str, list[float]]]], same: bool) -> None:  # fmt: skip
    print(
        f"{n_ranks} ranks ({k} matmuls a step, {args.step_ms:g} ms alone); {args.encodes} saves of "
        f"{args.frames} frames {args.width}x{args.height} float32; medians of {args.repeat}; "
        f"the workers in {PLACEMENTS[args.placement]}"
    )
    print(f"{'beside the ranks':>16} {'step mean':>9} {'x alone':>7} {'step p95':>8} "
          f"{'saves wall':>10} {'no ranks':>8} {'x':>6}")  # fmt: skip
    alone = rows[0]["step_mean_ms"]
    spread = (max(rows[0]["step_means_ms"]) - min(rows[0]["step_means_ms"])) / alone * 100
    for r in rows:
        ratio = r["step_mean_ms"] / alone
        walls = ("", "", "")
        if "wall_s" in r:
            walls = (f"{r['wall_s']:.2f} s", f"{r['bare_wall_s']:.2f} s",
                     f"{r['wall_s'] / r['bare_wall_s']:.1f}x")  # fmt: skip
        goal = ""
        if r["name"] == "yield":
            goal = f"  (goal <= {GOAL_STEP:g}: {'met' if ratio <= GOAL_STEP else 'MISSED'})"
        print(
            f"{r['name']:>16} {r['step_mean_ms']:>7.2f}ms {ratio:>7.3f} "
            f"{r['step_p95_ms']:>6.2f}ms {walls[0]:>10} {walls[1]:>8} {walls[2]:>6}{goal}"
        )
    print(
        f"the ranks alone: {len(rows[0]['step_means_ms'])} windows, their means within "
        f"{spread:.1f} % of each other (the noise of 'x alone')"
    )
    idle_tiny = harness.pct(probes["idle host"][0]["tiny_ms"], 0.99)
    ranks_tiny = harness.pct(probes["ranks alone"][0]["tiny_ms"], 0.99)
    print(
        f"{'probes':>16} {'health p99':>10} {'tiny p50':>8} {'tiny p99':>8} {'x idle host':>11} "
        f"{'x ranks alone':>13}"
    )
    for name, [got] in probes.items():
        tiny99, health99 = harness.pct(got["tiny_ms"], 0.99), harness.pct(got["health_ms"], 0.99)
        goal = ""
        if name == "yield":
            ok = tiny99 <= GOAL_TINY * idle_tiny and health99 <= GOAL_HEALTH_MS
            verdict = "met" if ok else "MISSED"
            goal = f"  (goal <= {GOAL_TINY:g}x idle host, <= {GOAL_HEALTH_MS:g} ms: {verdict})"
        print(
            f"{name:>16} {health99:>8.1f}ms {statistics.median(got['tiny_ms']):>6.1f}ms "
            f"{tiny99:>6.1f}ms {tiny99 / idle_tiny:>11.2f} {tiny99 / ranks_tiny:>13.2f}{goal}"
        )
    print(f"every file's sha256 equal to its in-process save's: {same}")


if __name__ == "__main__":
    harness.run(main)
