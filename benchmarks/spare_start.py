"""What a PyAV writer started ahead costs before its encode: its start's CPU and the memory
it holds while it waits.

    .venv/bin/python benchmarks/spare_start.py [--repeat 9] [--child PATH ...] [--json OUT]

The ``vllm-omni`` profile's child (service/_encode/pyav_writer.py, or each ``--child``
given: another copy of it, for a side by side) is started as the worker starts a spare
(service/_encode/spares.py: ``python -P CHILD --spare FD`` on a socket pair), left
until it waits on its socket, then its CPU seconds (user and system, /proc/PID/stat, at
the clock tick's 10 ms) and resident memory (VmRSS) are read and it is let go. The
children's runs interleave; medians of --repeat, min..max beside. The worker starts one
such spare after each PyAV encode, at niceness 19 (docs/configuration.md).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness
from encode import status_kib  # the shared /proc reader
from framewire.core.media.process import cpu_ticks

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "service" / "_encode" / "pyav_writer.py"
TICK = os.sysconf("SC_CLK_TCK")
IDLE_S = 0.05  # no CPU tick for this long: the spare waits on its socket


def _cpu_s(pid: int) -> float:
    ticks = cpu_ticks(pid)
    if ticks is None:
        raise SystemExit(f"spare {pid} is gone")
    return ticks / TICK


def one(child: Path) -> tuple[float, float]:
    """A spare of ``child`` started and waiting: (CPU seconds, resident MiB)."""
    mine, theirs = socket.socketpair()
    proc = subprocess.Popen(
        [sys.executable, "-P", str(child), "--spare", str(theirs.fileno())],
        pass_fds=[theirs.fileno()],
    )
    theirs.close()
    try:
        deadline, seen, still = time.monotonic() + 30, -1.0, 0.0
        while time.monotonic() < deadline:  # waiting: its CPU stands still
            time.sleep(IDLE_S)
            cpu = _cpu_s(proc.pid)
            still = still + IDLE_S if cpu == seen else 0.0
            seen = cpu
            if still >= 0.5 and proc.poll() is None:
                return cpu, status_kib(str(proc.pid), ("VmRSS",))[1] / 1024
        raise SystemExit(f"{child}: the spare never settled (exit {proc.poll()})")
    finally:
        mine.close()  # its socket's end: it exits
        proc.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=harness.count, default=9)
    parser.add_argument("--child", type=Path, action="append", default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    children = args.child or [CHILD]
    runs: dict[Path, list[tuple[float, float]]] = {c: [] for c in children}
    for _ in range(args.repeat):
        for child in children:
            runs[child].append(one(child))
    print("| child | start, CPU s | waiting, resident MiB |")
    print("| --- | ---: | ---: |")
    rows = []
    for child, got in runs.items():
        cpu, rss = [c for c, _ in got], [r for _, r in got]
        name = os.path.relpath(child, REPO)
        print(
            f"| {name} | {statistics.median(cpu):.2f} ({min(cpu):.2f}..{max(cpu):.2f}) "
            f"| {statistics.median(rss):.0f} ({min(rss):.0f}..{max(rss):.0f}) |"
        )
        rows.append({"child": name, "cpu_s": cpu, "rss_mib": rss})
    harness.write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    harness.run(main)
