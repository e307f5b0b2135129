"""An encode's time while unauthenticated clients flood the worker's open routes.

    .venv/bin/python benchmarks/flood.py [--repeat 5] [--frames 48] [--clients 12]

One worker; a --frames clip at --width x --height saved through it (the Python client,
its fd handover) under three conditions, taking turns round after round so drift hits
them alike:

- quiet: nothing else asks the worker anything;
- healthz: --clients threads ask ``/healthz`` (answered on the event loop) as fast as
  they are answered;
- readiness: the same threads ask ``/readyz`` and ``/v2/health/ready`` in turn (each
  asks whether the default ffmpeg runs);
- metrics: the same threads scrape ``/metrics`` (it asks the same, and renders every
  figure; it is open where no token is set).

Goal (issue: readiness that forks per request slowed a 48-frame encode 13-32x): readiness
costs what ``/healthz`` costs, so the encode's time under a readiness flood is within
noise of its time under a ``/healthz`` flood. The table gives each condition's median
and spread, the ratio to quiet, and the requests the flood had answered per second.
The flooding threads run in this process, on the same 2 cores as the worker: both
floods take CPU from the encode; what is compared is what readiness adds.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from encode import clip_chunk  # noqa: E402
from framewire.client import Client  # noqa: E402

from tests.support.worker import start_worker  # noqa: E402

ROUTES = {
    "healthz": ["/healthz"],
    "readiness": ["/readyz", "/v2/health/ready"],
    "metrics": ["/metrics"],
}


class Flood:
    """``clients`` threads asking ``routes`` in turn until stopped; counts the answers."""

    def __init__(self, url: str, routes: list[str], clients: int):
        self.url, self.routes = url, routes
        self.answered = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._ask, daemon=True) for _ in range(clients)]

    def _ask(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            i = 0
            while not self._stop.is_set():
                client.get(self.routes[i % len(self.routes)]).raise_for_status()
                i += 1
                with self._lock:
                    self.answered += 1

    def __enter__(self) -> Flood:
        self.started = time.perf_counter()
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        self.rate = self.answered / (time.perf_counter() - self.started)


def main() -> int:
    p = harness.parser(__doc__ or "", frames=48, width=832, height=480, repeat=5)
    p.add_argument("--clients", type=harness.count, default=12)
    args = p.parse_args()
    chunk = clip_chunk(0, args.frames, args.height, args.width)  # float32 CTHW
    clip = np.ascontiguousarray((chunk * 255).clip(0, 255).astype(np.uint8).transpose(1, 2, 3, 0))
    root = Path(tempfile.mkdtemp(prefix="framewire-bench-flood-"))
    worker = start_worker(root, "--log-level", "warning")
    times: dict[str, list[float]] = {"quiet": [], **{name: [] for name in ROUTES}}
    rates: dict[str, list[float]] = {name: [] for name in ROUTES}
    try:
        with Client(worker.uds_url) as fw:
            fw.save_video(clip, worker.outputs / "warm.mp4", fps=24)  # warm-up, untimed
            for r in range(args.repeat):
                for condition in times:
                    out = worker.outputs / f"{condition}-{r}.mp4"
                    if condition == "quiet":
                        t0 = time.perf_counter()
                        fw.save_video(clip, out, fps=24)
                        times[condition].append(time.perf_counter() - t0)
                        continue
                    with Flood(worker.tcp_url, ROUTES[condition], args.clients) as flood:
                        time.sleep(0.2)  # the flood under way before the encode starts
                        t0 = time.perf_counter()
                        fw.save_video(clip, out, fps=24)
                        times[condition].append(time.perf_counter() - t0)
                    rates[condition].append(flood.rate)
                    os.unlink(out)
    finally:
        worker.stop()
    quiet = statistics.median(times["quiet"])
    print(f"{args.frames} frames {args.width}x{args.height}, {args.clients} flooding clients, "
          f"{args.repeat} rounds (median; spread = min..max)")  # fmt: skip
    print(f"{'condition':<10} {'encode s':>9} {'spread s':>13} {'x quiet':>8} {'answers/s':>10}")
    rows = []
    for condition, runs in times.items():
        med = statistics.median(runs)
        rate = statistics.median(rates[condition]) if condition in rates else 0.0
        print(f"{condition:<10} {med:9.2f} {min(runs):6.2f}..{max(runs):5.2f} "
              f"{med / quiet:8.2f} {rate:10.0f}")  # fmt: skip
        rows.append({"condition": condition, "encode_s": runs, "answers_per_s": rate})
    ratio = statistics.median(times["readiness"]) / statistics.median(times["healthz"])
    print(f"readiness flood / healthz flood: {ratio:.2f}x")
    harness.write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    harness.run(main)
