"""What the PyAV template costs: its start's CPU and the memory it holds while it waits,
once per worker; and a job's answer (a writer forked, or its spare given the job), on
every encode's path.

    .venv/bin/python benchmarks/template_start.py [--repeat 9] [--forks 5] [--gap 0.2]
        [--template PATH ...] [--json OUT]

The ``vllm-omni`` profile's template (service/_encode/pyav_template.py, or each
``--template`` given: another copy of it, with its pyav_writer.py beside, for a side by
side) is started as the worker starts it (service/_encode/forks.py ``Template``:
``python -P TEMPLATE FD``),
left until it waits on its socket, then its CPU seconds (user and system,
/proc/PID/stat, at the clock tick's 10 ms) and resident memory (VmRSS) are read. Then
--forks writers are asked of it, one after another, each --gap seconds after the one
before ended (an engine's next save comes after its next generation; 0: back to back),
each for a one-frame 64x48 job (the worker's ``Template.fork``: the job sent, a writer
in a session of its own, its pid and pidfd answered: forked then, or the spare forked
ahead given the job), the answer timed; each writer is fed its frame and waited for.
The children's runs interleave; medians of --repeat (of every answer for the answer),
min..max beside. The worker starts its template after its first PyAV encode, in its
own session and at its weight (docs/configuration.md).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness
from encode import status_kib  # the shared /proc reader
from framewire.core.media.process import cpu_ticks
from framewire.service._encode.forks import Template

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "service" / "_encode" / "pyav_template.py"
TICK = os.sysconf("SC_CLK_TCK")
IDLE_S = 0.05  # no CPU tick for this long: the template waits on its socket


def _cpu_s(pid: int) -> float:
    ticks = cpu_ticks(pid)
    if ticks is None:
        raise SystemExit(f"template {pid} is gone")
    return ticks / TICK


def one(child: Path, forks: int, out: Path, gap_s: float) -> tuple[float, float, list[float]]:
    """The template ``child`` started and waiting: (CPU seconds, resident MiB, each
    job's answer in ms)."""
    template = Template([sys.executable, "-P", str(child)])
    pid = template.process.proc.pid
    try:
        deadline, seen, still = time.monotonic() + 30, -1.0, 0.0
        while time.monotonic() < deadline:  # waiting: its CPU stands still
            time.sleep(IDLE_S)
            cpu = _cpu_s(pid)
            still = still + IDLE_S if cpu == seen else 0.0
            seen = cpu
            if still >= 0.5 and template.process.proc.poll() is None:
                rss = status_kib(str(pid), ("VmRSS",))[1] / 1024
                return cpu, rss, [_fork(template, out, gap_s) for _ in range(forks)]
        raise SystemExit(
            f"{child}: the template never settled (exit {template.process.proc.poll()})"
        )
    finally:
        template.discard()


def _fork(template: Template, out: Path, gap_s: float) -> float:
    """One writer asked for a one-frame job, ``gap_s`` after the one before ended: the
    answer's ms."""
    time.sleep(gap_s)
    mine, theirs = socket.socketpair()
    stderr = os.memfd_create("stderr")
    job = ["--size", "64x48", "--rate", "24/1", "--crf", "18", "--threads", "1", str(out)]
    try:
        t0 = time.perf_counter()
        writer = template.fork(job, [], theirs.fileno(), stderr)
        took = (time.perf_counter() - t0) * 1e3
        assert writer.stdin is not None
        writer.stdin.write(bytes(64 * 48 * 3))
        writer.stdin.close()
        if writer.wait(30) != 0:
            raise SystemExit(f"a forked writer failed: {os.pread(stderr, 4096, 0).decode()}")
        return took
    finally:
        theirs.close()
        mine.close()
        os.close(stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=harness.count, default=9)
    parser.add_argument("--forks", type=harness.count, default=5)
    parser.add_argument("--gap", type=float, default=0.2)
    parser.add_argument("--template", type=Path, action="append", default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    children = args.template or [TEMPLATE]
    runs: dict[Path, list[tuple[float, float, list[float]]]] = {c: [] for c in children}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):
            for child in children:
                runs[child].append(one(child, args.forks, Path(tmp) / "one.mp4", args.gap))
    print("| template | start, CPU s | waiting, resident MiB | a job's answer, ms |")
    print("| --- | ---: | ---: | ---: |")
    rows = []
    for child, got in runs.items():
        cpu, rss = [c for c, _, _ in got], [r for _, r, _ in got]
        fork_ms = [ms for _, _, each in got for ms in each]
        name = os.path.relpath(child, REPO)
        print(
            f"| {name} | {statistics.median(cpu):.2f} ({min(cpu):.2f}..{max(cpu):.2f}) "
            f"| {statistics.median(rss):.0f} ({min(rss):.0f}..{max(rss):.0f}) "
            f"| {statistics.median(fork_ms):.1f} ({min(fork_ms):.1f}..{max(fork_ms):.1f}) |"
        )
        rows.append({"template": name, "cpu_s": cpu, "rss_mib": rss, "fork_ms": fork_ms})
    harness.write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    harness.run(main)
