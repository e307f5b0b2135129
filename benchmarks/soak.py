"""A rank's life: one client through many worker restarts and idle gaps.

    .venv/bin/python benchmarks/soak.py [--cycles 21] [--gap-s 2.5] [--idle-timeout-s 1]

Each cycle (tests/support/soak.py) idles past every timeout (the worker's idle
timeout is shortened so that a cycle stays short; the client's pool is as
shipped), saves, streams with a pause between chunks, decodes a reference, then
restarts the worker on the same sockets (SIGTERM, SIGKILL, or SIGTERM while the
rank keeps saving, in turn) and saves until the new worker serves. Saves in the
restart window go to the local fallback. Prints one table: calls ok / failed /
served locally, save latency p50/p99 in and out of restarts, the client-visible
gap per restart (signal -> the next save the worker serves) beside the worker's
own start time. Goal: 0 failed; the gap about the start time plus one retry.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from framewire.client import Client  # noqa: E402

from tests.support.soak import Soak  # noqa: E402
from tests.support.worker import Workers  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=21)
    parser.add_argument("--gap-s", type=float, default=2.5)
    parser.add_argument("--idle-timeout-s", type=float, default=1.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="framewire-soak-") as tmp:
        workers = Workers(lambda: Path(tmp) / "worker")
        soak = Soak(workers, ("--idle-timeout-s", str(args.idle_timeout_s)), gap_s=args.gap_s)
        try:
            with Client(soak.worker.uds_url, output_root=soak.worker.outputs) as fw:
                tally = soak.run(fw, args.cycles)
        finally:
            workers.stop_all()
    row = tally.row()
    print(f"# {args.cycles} restart cycles, idle gaps {args.gap_s:g} s "
          f"(worker idle timeout {args.idle_timeout_s:g} s)")  # fmt: skip
    print("| " + " | ".join(row) + " |")
    print("|" + " ---: |" * len(row))
    print("| " + " | ".join(row.values()) + " |")
    for failure in tally.failed:
        print("FAILED:", failure)
    return 1 if tally.failed else 0


if __name__ == "__main__":
    harness.run(main)
