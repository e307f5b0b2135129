"""Host-frame routes through the worker: a named shm segment against a sealed memfd handed
over on the fd socket, with bare ffmpeg beside them.

    .venv/bin/python benchmarks/routes.py [--frames 24 120 480] [--repeat 5] [--json OUT]

For each length the float32 CTHW clip of benchmarks/encode.py is written once
into a POSIX shm segment (and its rgb24 conversion into a /dev/shm file for
bare ffmpeg), and copied into a memfd sealed against shrinking, registered as a
region over the worker's fd socket. Then, in turn, repeated:

  bare ffmpeg          the encode argv reading the rgb24 file: the encoder's own limit
  named segment        POST /v1/videos:encode of the segment (the worker preads it)
  fd (sealed memfd)    the same of the region (the worker maps it, converts in place)

The frames are in place before the clock starts, as a rank's generated frames
would be. Every run passes the same x264 thread count, so the bytes must match.

  wall         the request (or ffmpeg) from start to answer
  worker CPU   the worker process's own user+system seconds over the request (its
               ffmpeg child excluded), and that as a fraction of the ffmpeg child's
  extra        the worker's resident memory (RssAnon + RssFile + RssShmem) sampled
               every 5 ms during the request, above a sample taken just before

Goals (benchmarks/README.md): the fd handover's worker CPU <= 0.08 of ffmpeg's;
wall <= 1.10x bare ffmpeg at 120 and 480 frames; extra <= 192 MiB, flat.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
import httpx  # noqa: E402
from encode import status_kib, write_clip  # noqa: E402  (the shared clip and /proc reader)
from framewire.client._sharing.fd import SEALS, FdRegions  # noqa: E402
from framewire.core.media.argv import encode_argv, x264_auto_threads  # noqa: E402
from framewire.core.media.process import resolve_ffmpeg  # noqa: E402

from tests.support.worker import Worker, start_worker  # noqa: E402

FPS = 24
VARIANTS = ("bare ffmpeg", "named segment", "fd (sealed memfd)")
GOAL_CPU, GOAL_WALL, GOAL_EXTRA_MIB = 0.08, 1.10, 192
OWN = ("RssAnon:", "RssFile:", "RssShmem:")


def cpu_share(row: dict) -> float:
    """The worker's CPU over ffmpeg's; NaN where ffmpeg's is below the clock's tick (a tiny
    clip: the tests' smoke run)."""
    return row["worker_cpu_s"] / row["ffmpeg_cpu_s"] if row["ffmpeg_cpu_s"] > 0 else float("nan")


def cpu_s(pid: int) -> tuple[float, float]:
    """(the process's own user+system seconds, its reaped children's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick


class Peak(threading.Thread):
    """The peak of ``pid``'s resident memory while running, in KiB."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self._done = pid, 0, threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, status_kib(str(self.pid), OWN)[1])

    def stop(self) -> int:
        self._done.set()
        self.join()
        return max(self.peak, status_kib(str(self.pid), OWN)[1])


def sealed_copy(segment: Path) -> int:
    """A memfd holding ``segment``'s bytes, sealed against shrinking and growing."""
    fd = os.memfd_create("framewire-bench", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    size = segment.stat().st_size
    with open(segment, "rb") as src:
        copied = 0
        while copied < size:
            copied += os.sendfile(fd, src.fileno(), copied, size - copied)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def through_worker(h: httpx.Client, w: Worker, source: dict[str, Any], threads: int) -> dict:
    body = {"outputs": [{"source": source, "path": "r.mp4", "fps": FPS, "threads": threads}]}
    own0, kids0 = cpu_s(w.pid)
    before = status_kib(str(w.pid), OWN)[1]
    peak = Peak(w.pid)
    peak.start()
    started = time.perf_counter()
    r = h.post("/v1/videos:encode", json=body)
    wall = time.perf_counter() - started
    top = peak.stop()
    own1, kids1 = cpu_s(w.pid)
    r.raise_for_status()
    out = r.json()["outputs"][0]
    if out["route"] != "stream":
        raise SystemExit(f"the worker took the {out['route']} route")
    (w.outputs / "r.mp4").unlink()
    return {"wall_s": wall, "worker_cpu_s": own1 - own0, "ffmpeg_cpu_s": kids1 - kids0,
            "extra_mib": (top - before) / 1024, "sha256": out["sha256"]}  # fmt: skip


def bare(rgb: Path, out: Path, width: int, height: int, threads: int) -> dict[str, Any]:
    argv = encode_argv(resolve_ffmpeg(None), width=width, height=height, fps=FPS, output=out,
                       threads=threads, stdin_name=str(rgb), guard=False)  # fmt: skip
    started = time.perf_counter()
    before = os.times()
    subprocess.run(argv, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    after = os.times()
    wall = time.perf_counter() - started
    kids = (
        after.children_user - before.children_user + after.children_system - before.children_system
    )
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    out.unlink()
    return {"wall_s": wall, "ffmpeg_cpu_s": kids, "sha256": digest}


def one_length(w: Worker, work: Path, frames: int, repeat: int, width: int, height: int) -> list:
    key = f"/framewire-bench-routes-{os.getpid()}"
    segment, rgb = Path(f"/dev/shm{key}"), Path(f"/dev/shm{key.lstrip('/')}.rgb")
    threads = x264_auto_threads(height)
    rows: list[dict[str, Any]] = []
    try:
        write_clip(segment, rgb, frames, height, width)
        size = segment.stat().st_size
        shape = [3, frames, height, width]
        named = {"kind": "shm", "key": key, "offset": 0, "byte_size": size, "dtype": "float32",
                 "shape": shape}  # fmt: skip
        memfd = sealed_copy(segment)
        with FdRegions(w.fd_socket, 600) as regions:
            transport = httpx.HTTPTransport(uds=str(w.uds))
            with httpx.Client(transport=transport, base_url="http://x", timeout=3600) as h:
                for i in range(repeat):  # interleaved, so drift hits every variant alike
                    runs = {
                        VARIANTS[0]: bare(rgb, work / "bare.mp4", width, height, threads),
                        VARIANTS[1]: through_worker(h, w, named, threads),
                    }
                    # Registered afresh each time, as save_video does: the worker maps it anew.
                    region = regions.register(memfd, 0, size)
                    fd_source = {"kind": "region", "region": region.name, "offset": 0,
                                 "byte_size": size, "dtype": "float32", "shape": shape}  # fmt: skip
                    runs[VARIANTS[2]] = through_worker(h, w, fd_source, threads)
                    regions.unregister(region)
                    rows += [
                        {"frames": frames, "variant": v, "run": i} | r for v, r in runs.items()
                    ]
        os.close(memfd)
    finally:
        segment.unlink(missing_ok=True)
        rgb.unlink(missing_ok=True)
    return rows


def spread(values: list[float]) -> str:
    m = statistics.median(values)
    return f"±{100 * (max(values) - min(values)) / 2 / m:.0f}%" if len(values) > 1 and m else ""


def main() -> int:
    parser = harness.parser(__doc__, frames=[24, 120, 480], width=1344, height=768, repeat=5)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="framewire-routes-") as tmp:
        w = start_worker(Path(tmp) / "worker", "--log-level", "warning")
        try:
            for frames in args.frames:
                rows += one_length(w, Path(tmp), frames, args.repeat, args.width, args.height)
        finally:
            w.stop()
    harness.write_json(args.json, rows)
    threads = x264_auto_threads(args.height)
    print(f"\n{args.width}x{args.height} float32, x264 fast, {threads} threads for all, "
          f"{os.cpu_count()} CPUs; median of {args.repeat} (± half the range)")  # fmt: skip
    print("| frames | route | wall | x bare ffmpeg | worker CPU | / ffmpeg CPU | worker extra |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    same = True
    for frames in args.frames:
        mine = [r for r in rows if r["frames"] == frames]
        same &= len({r["sha256"] for r in mine}) == 1
        base = statistics.median(r["wall_s"] for r in mine if r["variant"] == VARIANTS[0])
        for v in VARIANTS:
            got = [r for r in mine if r["variant"] == v]
            walls = [r["wall_s"] for r in got]
            line = f"| {frames} | {v} | {statistics.median(walls):.2f} s {spread(walls)} | "
            line += f"{statistics.median(walls) / base:.2f}x | "
            if v == VARIANTS[0]:
                line += "— | — | — |"
            else:
                cpu = [r["worker_cpu_s"] for r in got]
                frac = [cpu_share(r) for r in got]
                extra = [r["extra_mib"] for r in got]
                line += (f"{statistics.median(cpu):.2f} s | {statistics.median(frac):.3f} "
                         f"{spread(frac)} | {statistics.median(extra):.0f} MiB |")  # fmt: skip
            print(line)
    for frames in args.frames:
        mine = [r for r in rows if r["frames"] == frames]
        base = statistics.median(r["wall_s"] for r in mine if r["variant"] == VARIANTS[0])
        fd = [r for r in mine if r["variant"] == VARIANTS[2]]
        frac = statistics.median(cpu_share(r) for r in fd)
        wall = statistics.median(r["wall_s"] for r in fd) / base
        print(f"{frames} frames, fd handover: worker CPU {frac:.3f} of ffmpeg's "
              f"(goal <= {GOAL_CPU}) -> {'PASS' if frac <= GOAL_CPU else 'MISS'}; "
              f"wall {wall:.2f}x bare ffmpeg "
              f"(goal <= {GOAL_WALL}) -> {'PASS' if wall <= GOAL_WALL else 'MISS'}")  # fmt: skip
    extra = [r["extra_mib"] for r in rows if r["variant"] != VARIANTS[0]]
    verdict = "PASS" if max(extra) <= GOAL_EXTRA_MIB else "MISS"
    print(f"worker extra memory, every run: {min(extra):.0f} to {max(extra):.0f} MiB "
          f"(goal <= {GOAL_EXTRA_MIB}, flat) -> {verdict}")  # fmt: skip
    print(f"same bytes for every route and run: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    harness.run(main)
