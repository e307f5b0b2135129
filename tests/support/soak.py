"""A rank's life in fast-forward: one client through idle gaps and worker restarts.

Each cycle idles past every timeout, then saves, streams (with a pause between
chunks longer than the idle timeouts) and decodes a reference, then restarts the
worker under the client (SIGTERM, SIGKILL, or SIGTERM while the rank keeps saving)
and saves in a loop until the worker serves again: the client-visible gap. The
suite runs a few cycles (tests/system/test_soak.py); benchmarks/soak.py runs many
and prints the table.
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from framewire.client import Client, FramewireError

from tests.support.media import make_clip
from tests.support.refclips import CLIP_25, make_video
from tests.support.worker import Worker, Workers

RESTARTS = ("sigterm", "sigkill", "sigterm-busy")


@dataclass
class Tally:
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    local: int = 0  # served in the client's process (no worker)
    steady_ms: list[float] = field(default_factory=list)  # saves away from restarts
    restart_ms: list[float] = field(default_factory=list)  # saves in a restart window
    gaps_s: list[float] = field(default_factory=list)  # signal -> a save served by a worker
    starts_s: list[float] = field(default_factory=list)  # the worker's own start time
    stops_s: list[float] = field(default_factory=list)  # signal -> the old worker gone

    def call(self, what: str, fn: Callable[[], object], timed: list[float] | None = None) -> object:
        t0 = time.perf_counter()
        try:
            result = fn()
        except FramewireError as exc:
            self.failed.append(f"{what}: {exc}")
            return None
        if timed is not None:
            timed.append((time.perf_counter() - t0) * 1e3)
        self.ok += 1
        if getattr(result, "route", None) == "local":
            self.local += 1
        return result

    def row(self) -> dict[str, str]:
        def pct(values: list[float], q: float) -> str:
            if not values:
                return "-"
            ordered = sorted(values)
            return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))]:.0f}"

        return {
            "calls ok": str(self.ok),
            "failed": str(len(self.failed)),
            "served locally": str(self.local),
            "save p50/p99 ms (steady)": f"{pct(self.steady_ms, 0.5)} / {pct(self.steady_ms, 0.99)}",
            "save p50/p99 ms (restarts)": f"{pct(self.restart_ms, 0.5)} / "
            f"{pct(self.restart_ms, 0.99)}",
            "gap per restart s (median/max)": f"{statistics.median(self.gaps_s):.2f} / "
            f"{max(self.gaps_s):.2f}"
            if self.gaps_s
            else "-",
            "old worker gone s (median)": f"{statistics.median(self.stops_s):.2f}"
            if self.stops_s
            else "-",
            "new worker start s (median)": f"{statistics.median(self.starts_s):.2f}"
            if self.starts_s
            else "-",
        }


class Soak:
    def __init__(self, workers: Workers, args: tuple[str, ...], gap_s: float):
        self.workers = workers
        self.args = args
        self.gap_s = gap_s
        self.clip = make_clip(frames=8, height=48, width=64)
        self.tally = Tally()
        self.worker: Worker = workers.start(*args)
        self.root = self.worker.uds.parent
        self.reference: Path = make_video(self.worker.inputs / "soak-ref.mp4", *CLIP_25)

    def run(self, fw: Client, cycles: int) -> Tally:
        for i in range(cycles):
            time.sleep(self.gap_s)  # a rank generating: past every idle timeout
            self.work(fw, i)
            self.restart(fw, RESTARTS[i % len(RESTARTS)], i)
        return self.tally

    def work(self, fw: Client, i: int) -> None:
        t = self.tally
        t.call("save", lambda: fw.save_video(self.clip, f"soak/{i}.mp4", fps=24), t.steady_ms)
        t.call("stream", lambda: self.stream(fw, f"soak/{i}-s.mp4"))
        t.call("decode", lambda: self.decode(fw))

    def stream(self, fw: Client, path: str) -> object:
        with fw.open_video(path, fps=24) as out:
            for chunk in torch.split(self.clip, 4, dim=1):
                out.write(chunk)
                time.sleep(self.gap_s)  # a slow VAE
        return out.result

    def decode(self, fw: Client) -> object:
        with fw.decode_reference(self.reference, fps=8, width=64, height=48) as ref:
            assert ref.frames.shape[1:] == (48, 64, 3)
        return None

    def restart(self, fw: Client, how: str, i: int) -> None:
        """Stop the worker, start its successor on the same sockets, and save until the
        successor serves: every save meanwhile must succeed (locally)."""
        old = self.worker
        signalled = time.monotonic()
        old.proc.send_signal(signal.SIGKILL if how == "sigkill" else signal.SIGTERM)
        if how == "sigterm-busy":  # the rank saves while the old worker drains
            self.tally.call(
                "save", lambda: fw.save_video(self.clip, f"soak/{i}-d.mp4", fps=24),
                self.tally.restart_ms,
            )  # fmt: skip
        old.proc.wait(timeout=60)
        self.tally.stops_s.append(time.monotonic() - signalled)
        started: list[Worker] = []
        thread = threading.Thread(target=lambda: started.append(self.start()))
        thread.start()
        for n in itertools.count():
            save = functools.partial(fw.save_video, self.clip, f"soak/{i}-r{n}.mp4", fps=24)
            result = self.tally.call("save", save, self.tally.restart_ms)
            if getattr(result, "route", None) not in (None, "local"):
                break
            if not thread.is_alive() and not started:
                raise RuntimeError("the successor worker did not start")
            time.sleep(0.2)
        thread.join()
        self.tally.gaps_s.append(time.monotonic() - signalled)
        self.worker = started[0]

    def start(self) -> Worker:
        t0 = time.monotonic()
        worker = self.workers.start(*self.args, root=self.root)
        self.tally.starts_s.append(time.monotonic() - t0)  # the worker's own start
        return worker


def open_fds() -> Counter[str]:
    """What this process's descriptors name, counted (the same file held twice is two)."""
    found: Counter[str] = Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found[os.readlink(f"/proc/self/fd/{fd}")] += 1
        except OSError:
            pass
    return found
