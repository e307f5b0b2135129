"""Encode benchmark: bare ffmpeg, the in-process imageio path and framewire, side by side.

    .venv/bin/python benchmarks/encode.py [--frames 48 120 240] [--width 1344 --height 768]
                                          [--repeat N] [--json OUT] [--figures DIR]

For each length a deterministic float32 CTHW clip (values in [0, 1]: moving
gradients plus noise) is written chunk by chunk into a POSIX shm segment, and
the same clip converted to rgb24 into a /dev/shm file. Then, each in a fresh
process so their memory figures are independent:

  bare ffmpeg  the encode argv reading the prepared rgb24 file (the encoder's own limit)
  imageio      the segment mapped as a tensor, converted whole, imageio.mimsave
  framewire    FileSource over the segment, Encoder's stream route

All three pass the same x264 thread count, so their outputs must be byte-identical.
"Peak extra" is the worker's resident memory (RssAnon + RssFile + RssShmem),
sampled every 5 ms during the encode, above a sample taken just before it; the
imageio path's mapped input is touched before that sample, so it is not counted.
The goals are in benchmarks/README.md. Beside the table it draws the wall ratio
(encode-wall.png) and the extra memory (encode-memory.png) against clip length.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import harness
import numpy as np
import plots

VARIANTS = ("bare ffmpeg", "imageio", "framewire")
PREFIX = "/framewire-bench-"
FPS = 24
GEN_CHUNK = 8  # frames generated (and converted) per step
GOAL_WALL_FRAMES, GOAL_WALL_RATIO, GOAL_EXTRA_MIB = 120, 1.10, 192
MIB = 1 << 20


# ----------------------------------------------------------------------------- the clip


def clip_chunk(t0: int, t1: int, height: int, width: int) -> np.ndarray:
    """Frames [t0, t1) of the clip, (3, t, H, W) float32 in [0, 1]; depends only on (t0, t1)."""
    t = np.arange(t0, t1, dtype=np.float32)[:, None, None]
    y = np.linspace(0, 1, height, dtype=np.float32)[None, :, None]
    x = np.linspace(0, 1, width, dtype=np.float32)[None, None, :]
    rng = np.random.default_rng([1234, t0, t1])
    planes = []
    for c in range(3):
        phase = 2 * np.pi * (x * (1.0 + c) + 0.6 * y + t * (0.011 + 0.004 * c))
        wave = np.sin(phase) * np.cos(2 * np.pi * (y * (1.5 - 0.3 * c) - t * 0.007))
        noise = rng.random((t1 - t0, height, width), dtype=np.float32)
        planes.append(np.clip(0.5 + 0.38 * wave + 0.08 * (noise - 0.5), 0, 1))
    return np.stack(planes).astype(np.float32, copy=False)


def write_clip(
    segment: Path, rgb: Path, frames: int, height: int, width: int, first: int = 0
) -> None:
    """The float32 CTHW clip into ``segment`` and its rgb24 THWC conversion into ``rgb``:
    frames [first, first + frames) of the endless clip (distinct ``first``, distinct clips)."""
    import torch

    pixels = height * width
    plane = frames * pixels * 4
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
    seg_fd, rgb_fd = os.open(segment, flags, 0o600), os.open(rgb, flags, 0o600)
    try:
        os.ftruncate(seg_fd, 3 * plane)
        for t0 in range(0, frames, GEN_CHUNK):
            t1 = min(t0 + GEN_CHUNK, frames)
            chunk = clip_chunk(first + t0, first + t1, height, width)
            for c in range(3):
                os.pwrite(seg_fd, chunk[c].data, c * plane + t0 * pixels * 4)
            u8 = (torch.from_numpy(chunk) * 255).clamp(0, 255).to(torch.uint8)
            thwc = u8.permute(1, 2, 3, 0).contiguous().numpy()
            os.pwrite(rgb_fd, thwc.data, t0 * pixels * 3)
    finally:
        os.close(seg_fd)
        os.close(rgb_fd)


# ----------------------------------------------------------------------------- one run


def status_kib(pid: str, fields: tuple[str, ...]) -> tuple[str, int]:
    """(The executable's file name, sum of ``fields`` in KiB) from /proc/PID.

    The file name, not the process's Name: the worker runs ffmpeg from a descriptor
    (/proc/self/fd/N), whose Name is then the descriptor's number."""
    total = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(fields):
                total += int(line.split()[1])
    return os.path.basename(os.readlink(f"/proc/{pid}/exe")), total


def child_pids() -> list[str]:
    me, found = os.getpid(), []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry.name}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                    found.append(entry.name)
    return found


class Sampler:
    """Samples this process's resident memory and its ffmpeg child's high-water mark.

    ``extra_mib`` is the peak of RssAnon + RssFile + RssShmem above the sample
    taken on entry. ffmpeg's peak is its own VmHWM, which starts afresh at exec:
    getrusage(RUSAGE_CHILDREN).ru_maxrss would also count the Python process's
    resident set at the moment it spawned ffmpeg (the kernel carries the old
    mm's high-water mark across exec), inputs and all.
    """

    OWN = ("RssAnon:", "RssFile:", "RssShmem:")

    def __init__(self, period: float = 0.005):
        self.period = period
        self.baseline = self.peak = self.ffmpeg_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        children: list[str] = []
        tick = 0
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, status_kib("self", self.OWN)[1])
            tick += 1
            if not children and tick % 5 == 0:  # looking for ffmpeg costs ~1 ms
                children = child_pids()
            for pid in list(children):
                try:
                    name, hwm = status_kib(pid, ("VmHWM:",))
                except OSError:
                    children.remove(pid)  # gone (and reaped)
                    continue
                if name.startswith("ffmpeg"):  # not the pre-exec copy of Python
                    self.ffmpeg_kib = max(self.ffmpeg_kib, hwm)

    def __enter__(self) -> Sampler:
        self.baseline = self.peak = status_kib("self", self.OWN)[1]
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, status_kib("self", self.OWN)[1])

    @property
    def extra_mib(self) -> float:
        return (self.peak - self.baseline) / 1024


def imageio_save(x: Any, out: str | Path, threads: int) -> None:
    """The imageio path in process: a (3, T, H, W) float tensor converted whole with the
    standard formula, then ``imageio.mimsave`` with the thread count pinned."""
    import imageio
    import torch

    u8 = (x * 255).clamp(0, 255).to(torch.uint8).permute(1, 2, 3, 0)
    imageio.mimsave(
        out, list(u8.numpy()), fps=FPS, codec="libx264", quality=5,
        output_params=["-preset", "fast", "-threads", str(threads)],
    )  # fmt: skip


def run_variant(spec: dict[str, Any]) -> dict[str, Any]:
    """One encode in this (fresh) process: its wall time and memory figures. Each variant
    imports only what it runs (the bare one neither torch nor the service)."""
    from framewire.core.media.argv import encode_argv
    from framewire.core.media.process import resolve_ffmpeg

    variant, out, n = spec["variant"], spec["out"], spec["threads"]
    frames, height, width = spec["frames"], spec["height"], spec["width"]
    ffmpeg = resolve_ffmpeg()  # imageio-ffmpeg's lookup runs `ffmpeg -version` once: not timed
    sampler = Sampler()
    if variant == "bare ffmpeg":
        argv = encode_argv(
            ffmpeg, width=width, height=height, fps=FPS, output=out, threads=n,
            stdin_name=spec["rgb"], guard=False,  # "bare": the contract argv as it is
        )  # fmt: skip
        with sampler:
            started = time.perf_counter()
            subprocess.run(argv, stdin=subprocess.DEVNULL, check=True)
            wall = time.perf_counter() - started
    elif variant == "imageio":
        import torch

        fd = os.open(f"/dev/shm{spec['key']}", os.O_RDWR)
        mapping = mmap.mmap(fd, 3 * frames * height * width * 4)
        # Fault the whole input in first: it is the input, not memory the encode adds.
        np.frombuffer(mapping, dtype=np.uint8)[:: mmap.PAGESIZE].sum()
        x = torch.frombuffer(mapping, dtype=torch.float32).view(3, frames, height, width)
        with sampler:
            started = time.perf_counter()
            imageio_save(x, out, n)
            wall = time.perf_counter() - started
    else:
        from framewire.client.wire import DType, Layout
        from framewire.service._convert import kernels
        from framewire.service._convert.convert import single_threaded_conversion
        from framewire.service._encode.encoder import EncodeParams, Encoder
        from framewire.service._sources.frames import FileSource, Geometry
        from framewire.service._sources.shm import open_shm

        single_threaded_conversion()  # as `framewire serve` configures its process
        kernels.warm()  # as it does at start: the compiler's memory is not the encode's
        fd = open_shm(spec["key"], ["/framewire"])
        src = FileSource(fd, 0, Geometry(DType.float32, Layout.CTHW, frames, height, width))
        encoder = Encoder(ffmpeg, chunk_bytes=spec["chunk_bytes"])
        try:
            with sampler:
                started = time.perf_counter()
                result = encoder.encode(src, out, EncodeParams(fps=FPS, threads=n))
                wall = time.perf_counter() - started
        finally:
            src.close()
        if result.route != "stream":
            raise SystemExit(f"framewire took the {result.route} route: {result.fast_path_error}")
    return {
        "wall_s": wall,
        "peak_extra_mib": None if variant == "bare ffmpeg" else sampler.extra_mib,
        "ffmpeg_peak_rss_mib": sampler.ffmpeg_kib / 1024,
        # Shown for comparison only: inflated by the spawning process (see Sampler).
        "rusage_children_maxrss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


# ----------------------------------------------------------------------------- the driver


def spawn(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one variant in a fresh interpreter; its last stdout line is the result."""
    argv = [sys.executable, os.path.abspath(__file__), "--_run", json.dumps(spec)]
    proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_length(frames: int, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    from framewire.core.media.argv import x264_auto_threads
    from framewire.service._encode.encoder import sha256_file

    key = f"{PREFIX}{os.getpid()}-{frames}"
    segment, rgb = Path(f"/dev/shm{key}"), work / f"clip-{frames}.rgb"
    threads = x264_auto_threads(args.height)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    try:
        print(f"{frames} frames: writing the clip ...", file=sys.stderr, flush=True)
        write_clip(segment, rgb, frames, args.height, args.width)
        for rep in range(args.repeat):
            for variant in VARIANTS:
                print(f"{frames} frames: {variant} ({rep + 1}/{args.repeat})", file=sys.stderr)
                out = work / f"{variant.replace(' ', '-')}-{frames}.mp4"
                out.unlink(missing_ok=True)
                spec = {
                    "variant": variant, "key": key, "rgb": str(rgb), "out": str(out),
                    "frames": frames, "height": args.height, "width": args.width,
                    "threads": threads, "chunk_bytes": args.chunk_mib * MIB,
                }  # fmt: skip
                runs[variant].append(spawn(spec) | {"sha256": sha256_file(Path(out))})
                out.unlink()
    finally:
        segment.unlink(missing_ok=True)
        rgb.unlink(missing_ok=True)

    reference = runs["bare ffmpeg"][0]["sha256"]
    base_wall = statistics.median(r["wall_s"] for r in runs["bare ffmpeg"])
    rows = []
    for variant, results in runs.items():
        wall = statistics.median(r["wall_s"] for r in results)
        extras = [r["peak_extra_mib"] for r in results if r["peak_extra_mib"] is not None]
        rows.append(
            {
                "frames": frames, "variant": variant, "threads": threads,
                "wall_s": wall, "walls_s": [r["wall_s"] for r in results],
                "x_bare": wall / base_wall,
                "peak_extra_mib": max(extras) if extras else None,
                "ffmpeg_peak_rss_mib": max(r["ffmpeg_peak_rss_mib"] for r in results),
                "rusage_children_maxrss_mib": max(r["rusage_children_maxrss_mib"] for r in results),
                "sha256": results[0]["sha256"],
                "same_bytes": all(r["sha256"] == reference for r in results),
            }
        )  # fmt: skip
    return rows


def report(rows: list[dict[str, Any]]) -> None:
    head = ("frames", "variant", "wall s", "x bare ffmpeg", "peak extra MiB",
            "ffmpeg peak RSS MiB", "same bytes")  # fmt: skip
    widths = [15 if i == 1 else len(h) for i, h in enumerate(head)]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.ljust(w) if i == 1 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    print(line(head))
    for i, r in enumerate(rows):
        if i == 0 or rows[i - 1]["frames"] != r["frames"]:
            print("  ".join("-" * w for w in widths))
        extra = r["peak_extra_mib"]
        print(line((
            str(r["frames"]), r["variant"], f"{r['wall_s']:.2f}", f"{r['x_bare']:.2f}x",
            "— (is ffmpeg)" if extra is None else f"{extra:.0f}",
            f"{r['ffmpeg_peak_rss_mib']:.0f}", "yes" if r["same_bytes"] else "NO",
        )))  # fmt: skip

    ours = [r for r in rows if r["variant"] == "framewire"]
    at = [r["x_bare"] for r in ours if r["frames"] == GOAL_WALL_FRAMES]
    if at:
        got = f"{at[0]:.2f}x {'PASS' if at[0] <= GOAL_WALL_RATIO else 'MISS'}"
    else:
        got = f"n/a ({GOAL_WALL_FRAMES} frames not measured)"
    print(
        f"goal: framewire wall <= {GOAL_WALL_RATIO:.2f}x bare at {GOAL_WALL_FRAMES} frames: {got}"
    )
    each = ", ".join(f"{r['peak_extra_mib']:.0f} at {r['frames']}" for r in ours)
    ok = all(r["peak_extra_mib"] <= GOAL_EXTRA_MIB for r in ours)
    print(f"goal: framewire peak extra <= {GOAL_EXTRA_MIB} MiB at every length: {each} MiB "
          f"{'PASS' if ok else 'MISS'}")  # fmt: skip


def plot(rows: list[dict[str, Any]], directory: Path, note: str) -> None:
    def series(key: str, variants: tuple[str, ...]) -> dict[str, tuple[list[float], list[float]]]:
        return {
            v: ([r["frames"] for r in rows if r["variant"] == v],
                [r[key] for r in rows if r["variant"] == v])
            for v in variants
        }  # fmt: skip

    length = "clip length (frames, log scale)"
    title = "Encode wall time, as a multiple of bare ffmpeg's"
    with plots.figure(directory / "encode-wall.png", title, note=note) as [ax]:
        plots.lines(ax, series("x_bare", VARIANTS), xlabel=length, ylabel="wall / bare ffmpeg",
                    log_x=True)  # fmt: skip
        plots.reference(ax, GOAL_WALL_RATIO, f"goal: {GOAL_WALL_RATIO:.2f}x")
    title = "Extra memory of the encoding process"
    with plots.figure(directory / "encode-memory.png", title, note=note) as [ax]:
        plots.lines(ax, series("peak_extra_mib", VARIANTS[1:]), xlabel=length,
                    ylabel="peak extra resident memory (MiB, log scale)", log_x=True,
                    log_y=True)  # fmt: skip
        plots.reference(ax, GOAL_EXTRA_MIB, f"goal: <= {GOAL_EXTRA_MIB} MiB, flat")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=harness.count, nargs="+", default=[48, 120, 240])
    parser.add_argument("--width", type=harness.count, default=1344)
    parser.add_argument("--height", type=harness.count, default=768)
    parser.add_argument(
        "--repeat", type=harness.count, default=1, help="runs per variant; wall is the median"
    )
    parser.add_argument(
        "--chunk-mib", type=harness.count, default=128, help="framewire's chunk_bytes"
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    plots.add_option(parser)
    parser.add_argument("--_run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._run:
        print(json.dumps(run_variant(json.loads(args._run))), flush=True)
        return 0

    work = Path(tempfile.mkdtemp(prefix=PREFIX.lstrip("/"), dir="/dev/shm"))
    try:
        rows = [row for frames in args.frames for row in bench_length(frames, args, work)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    from framewire.core.media.argv import crf_for_quality

    setup = (
        f"{args.width}x{args.height} float32 CTHW clip in shm, {FPS} fps, x264 fast "
        f"crf {crf_for_quality(5)}, -threads {rows[0]['threads']} for all"
    )
    print(f"{setup}, {os.cpu_count()} CPUs, median of {args.repeat}")
    report(rows)
    harness.write_json(args.json, rows)
    plot(rows, args.figures, f"{setup}; median of {args.repeat}")
    return 0 if all(r["same_bytes"] for r in rows) else 1


if __name__ == "__main__":
    harness.run(main)
