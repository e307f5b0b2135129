"""A rank's CPU work as benchmarks/ranks.py times it: one thread of torch matmuls, a step
at a time, every step's end and length kept.

    python rank_loop.py RANKS MATMULS OUT_DIR     # in a container of its own (ranks.py)

Run as a script it starts RANKS such processes and stops them when OUT_DIR/stop appears,
then writes OUT_DIR/ranks.json: each rank's (ends, seconds) of its steps, ends on the
host's monotonic clock (CLOCK_MONOTONIC is one for every container of a host). It needs
torch alone: the worker's image runs it.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any


def work(size: int = 256) -> tuple[Any, Any]:
    import torch

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    return torch.rand(size, size, generator=g), torch.rand(size, size, generator=g) / size


def step(a: Any, w: Any, k: int) -> Any:
    for _ in range(k):
        a = (a @ w).tanh_()
    return a


def calibrate(step_ms: float) -> int:
    """Matmuls a step takes to last ``step_ms`` here (measured before anything else runs)."""
    a, w = work()
    step(a, w, 50)  # warm
    t0 = time.perf_counter()
    step(a, w, 200)
    per = (time.perf_counter() - t0) / 200
    return max(1, round(step_ms / 1e3 / per))


def rank(k: int, conn: Connection) -> None:
    """Steps until told to stop, then sends (end, seconds) of each step."""
    a, w = work()
    ends: list[float] = []
    took: list[float] = []
    conn.send("started")
    while not conn.poll():
        t0 = time.monotonic()
        a = step(a, w, k)
        t1 = time.monotonic()
        ends.append(t1)
        took.append(t1 - t0)
    conn.recv()
    conn.send((ends, took))


def main() -> None:
    n, k, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    ctx = multiprocessing.get_context("fork")
    conns = []
    for _ in range(n):
        mine, theirs = ctx.Pipe()
        ctx.Process(target=rank, args=(k, theirs), daemon=True).start()
        conns.append(mine)
    for conn in conns:
        assert conn.recv() == "started"
    (out / "started").touch()
    while not (out / "stop").exists():
        time.sleep(0.1)
    for conn in conns:
        conn.send("stop")
    ranks = [conn.recv() for conn in conns]
    (out / "ranks.json").write_text(json.dumps(ranks))


if __name__ == "__main__":
    main()
