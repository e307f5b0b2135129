"""vLLM-omni's saves one after another: its ``ChunkedMP4Encoder`` in process, and through
workers whose PyAV writers are started afresh or forked from a template.

    .venv/bin/python benchmarks/back_to_back.py [--frames 33 --width 832 --height 480]
        [--saves 8] [--gaps 0 0.5] [--writers fresh forked] [--repeat 4] [--json OUT]

One engine process per run (benchmarks/engine_save.py, its ``vllm-omni-encoder`` row:
the session's uint8 8-frame chunks made before the timing, ultrafast, threads 0), warmed
up by one tiny save, then --saves saves of the clip, each --gaps seconds after the one
before (0: back to back, as a busy engine's; 0.5: spaced). "off": vLLM-omni's own
encoder; "fresh" and "forked": the integration on, against a worker started with
``FRAMEWIRE_PYAV_FORK`` false (each writer an interpreter started for its encode) or
true (each forked from the template, service/_encode/forks.py), each holding SGLang's
ffmpeg and yielding as it ships (engines.py's). Runs interleave (gap, then off and each
kind); figures: the median wall of a save over every save of --repeat runs (quartiles
beside), and its ratio to off; then the CPU seconds a save costs the host, the median
of the runs: the engine process's (engine_save.py's, its children waited for
included) and, on, the worker's whole process tree's over the run (each process's own
and its reaped children's, /proc/PID/stat: the writers, started afresh or forked, and
SGLang's ffmpeg idle) divided by the saves.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from engines import one  # noqa: E402
from routes import cpu_s  # noqa: E402

from tests.support.engine_site import engine_ffmpeg, engine_site  # noqa: E402
from tests.support.worker import start_worker  # noqa: E402

ENGINE = "vllm-omni-encoder"
WRITERS = {"fresh": "false", "forked": "true"}  # FRAMEWIRE_PYAV_FORK


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and every process below it, each one's reaped children's
    included (a child reaped between two reads may be missed once: 10 ms ticks anyway)."""
    total, todo = 0.0, [pid]
    while todo:
        at = todo.pop()
        try:
            own, reaped = cpu_s(at)
            for task in Path(f"/proc/{at}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # gone meanwhile
            continue
        total += own + reaped
    return total


def quartiles(walls: list[float]) -> str:
    if len(walls) < 2:
        return f"{walls[0]:.3f}"
    q1, q2, q3 = statistics.quantiles(walls, n=4)
    return f"{q2:.3f} ({q1:.3f}..{q3:.3f})"


def main() -> int:
    p = harness.parser(__doc__, frames=33, width=832, height=480, repeat=4)
    p.add_argument("--saves", type=harness.count, default=8)
    p.add_argument("--gaps", type=float, nargs="+", default=[0.0, 0.5])
    p.add_argument("--writers", nargs="+", choices=WRITERS, default=list(WRITERS))
    args = p.parse_args()
    ffmpeg = str(engine_ffmpeg(engine_site("sglang")))
    modes: list[str | None] = [None, *args.writers]  # None: off
    walls: dict[tuple[float, str | None], list[float]] = {}
    cpus: dict[tuple[float, str | None], list[float]] = {}  # a save's, each run's
    shas: set[str] = set()
    with tempfile.TemporaryDirectory() as tmp:
        workers: dict[str, Any] = {}
        try:
            for kind in args.writers:
                env = {**os.environ, "FRAMEWIRE_PYAV_FORK": WRITERS[kind]}
                workers[kind] = start_worker(
                    Path(tmp) / kind, "--encoders", ffmpeg, yielding=True, env=env
                )
            for r in range(args.repeat):
                for gap in args.gaps:
                    for mode in modes:
                        worker = workers[mode] if mode is not None else next(iter(workers.values()))
                        before = tree_cpu_s(worker.pid) if mode is not None else 0.0
                        got = one(ENGINE, mode is not None, worker, args, r,
                                  saves=[str(args.saves), str(gap)])  # fmt: skip
                        spent = tree_cpu_s(worker.pid) - before if mode is not None else 0.0
                        walls.setdefault((gap, mode), []).extend(got["walls"])
                        cpus.setdefault((gap, mode), []).append(got["cpu_s"] + spent / args.saves)
                        shas.add(got["sha256"])
        finally:
            for worker in workers.values():
                worker.stop()
    print(f"{args.frames} frames {args.width}x{args.height}, {args.saves} saves a run, "
          f"{args.repeat} runs: a save's wall, median (quartiles)")  # fmt: skip
    head = " | ".join(["off", *args.writers])
    print(f"| gap s | {head} |")
    print("| ---: |" + " ---: |" * len(modes))
    rows = []
    for gap in args.gaps:
        off = statistics.median(walls[(gap, None)])
        cells = []
        for mode in modes:
            median = statistics.median(walls[(gap, mode)])
            ratio = "" if mode is None else f" {median / off:.2f}x"
            cells.append(quartiles(walls[(gap, mode)]) + ratio)
            row = {"gap_s": gap, "writers": mode, "walls": walls[(gap, mode)]}
            rows.append({**row, "cpu_s": cpus[(gap, mode)]})
        print(f"| {gap:g} | " + " | ".join(cells) + " |")
    print("\nCPU seconds a save (the engine's, and the worker's on), median of the runs")
    print(f"| gap s | {head} |")
    print("| ---: |" + " ---: |" * len(modes))
    for gap in args.gaps:
        cells = [f"{statistics.median(cpus[(gap, mode)]):.3f}" for mode in modes]
        print(f"| {gap:g} | " + " | ".join(cells) + " |")
    same = len(shas) == 1
    print(f"every save's sha256 equal: {same}")
    harness.write_json(args.json, {"rows": rows, "same_bytes": same})
    return 0 if same else 1


if __name__ == "__main__":
    harness.run(main)
