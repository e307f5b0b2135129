"""GPU encode benchmark: a CUDA clip handed to a framewire worker, vs bare ffmpeg.

    python3 benchmarks/gpu_encode.py [--frames 120 240] [--width 1344 --height 768]
                                     [--repeat 2] [--json OUT]

Needs an NVIDIA GPU and framewire importable (installed, or on PYTHONPATH as
scripts/gpu-check arranges). For each length this process plays the inference
rank: it makes a deterministic float32 CTHW clip on the GPU and writes that
clip's rgb24 conversion to a file in /dev/shm. Then, side by side:

  bare ffmpeg   the encode argv reading the rgb24 file: the encoder's own limit
  framewire     Client.save_video of the CUDA tensor through a fresh worker
                process: CUDA IPC, conversion on the GPU, sendfile into ffmpeg

Both pass the same x264 thread count, so their outputs must be byte-identical.
Measured in this process on the same clip:

  convert+copy  the worker's GPU converter alone, chunk by chunk into host
                staging, page-locked and pageable: GB/s of float input read
                (and of rgb24 written)
  naive         ``(x * 255).clamp(0, 255).to(uint8)`` on the whole clip, then the
                permuted copy to the host, as the in-process save path does

"Peak GPU MiB" is torch.cuda.max_memory_allocated: the worker's over its whole
life (reported by /v1/info), and the naive path's above the clip itself.
The goals are in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import torch

FPS = 24
MIB = 1 << 20
GEN_CHUNK = 16  # frames generated (and converted for the rgb24 file) per step
GOAL_WALL_FRAMES, GOAL_WALL_RATIO = 120, 1.03


# ----------------------------------------------------------------------------- the clip


def make_clip(frames: int, height: int, width: int, device: torch.device) -> torch.Tensor:
    """(3, T, H, W) float32 in [0, 1]: moving waves plus a little seeded noise."""
    clip = torch.empty((3, frames, height, width), dtype=torch.float32, device=device)
    gen = torch.Generator(device=device).manual_seed(1234)
    y = torch.linspace(0, 1, height, device=device).view(1, height, 1)
    x = torch.linspace(0, 1, width, device=device).view(1, 1, width)
    for t0 in range(0, frames, GEN_CHUNK):
        t1 = min(t0 + GEN_CHUNK, frames)
        t = torch.arange(t0, t1, device=device, dtype=torch.float32).view(-1, 1, 1)
        for c in range(3):
            phase = 2 * torch.pi * (x * (1.0 + c) + 0.6 * y + t * (0.011 + 0.004 * c))
            wave = torch.sin(phase) * torch.cos(2 * torch.pi * (y * (1.5 - 0.3 * c) - t * 0.007))
            noise = torch.rand((t1 - t0, height, width), generator=gen, device=device)
            clip[c, t0:t1] = (0.5 + 0.38 * wave + 0.08 * (noise - 0.5)).clamp(0, 1)
    return clip


def write_rgb(clip: torch.Tensor, path: Path) -> None:
    """The standard conversion of ``clip`` as rgb24 frames, chunk by chunk, into ``path``."""
    with open(path, "wb") as f:
        for t0 in range(0, clip.shape[1], GEN_CHUNK):
            chunk = clip[:, t0 : t0 + GEN_CHUNK]
            u8 = (chunk * 255).clamp(0, 255).to(torch.uint8)
            f.write(u8.permute(1, 2, 3, 0).contiguous().cpu().numpy().tobytes())


# ----------------------------------------------------------------------------- the worker


class Worker:
    """A `framewire serve` process with its own roots and sockets under ``root``."""

    def __init__(self, root: Path):
        self.root = root
        self.outputs = root / "outputs"
        self.outputs.mkdir(parents=True)
        (root / "inputs").mkdir()
        self.uds = root / "api.sock"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        argv = [
            sys.executable, "-m", "framewire.service", "serve", "--port", str(port),
            "--uds", str(self.uds), "--fd-socket", str(root / "fd.sock"),
            "--output-roots", str(self.outputs), "--input-roots", str(root / "inputs"),
            "--log-level", "warning",
        ]  # fmt: skip
        self.log = open(root / "worker.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    @property
    def url(self) -> str:
        return f"unix://{self.uds}"

    def _wait_ready(self, timeout: float = 120) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the worker exited:\n{(self.root / 'worker.log').read_text()}")
            if self.uds.exists():
                try:
                    with httpx.Client(transport=httpx.HTTPTransport(uds=str(self.uds))) as h:
                        if h.get("http://framewire/healthz").status_code == 200:
                            return
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
        self.stop()
        raise SystemExit("the worker did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ----------------------------------------------------------------------------- measurements


def bare_ffmpeg(rgb: Path, out: Path, frames: int, args: argparse.Namespace, threads: int) -> float:
    from framewire.core.media.argv import encode_argv
    from framewire.core.media.process import resolve_ffmpeg

    argv = encode_argv(
        resolve_ffmpeg(), width=args.width, height=args.height, fps=FPS, output=out,
        threads=threads, stdin_name=str(rgb), guard=False,
    )  # fmt: skip
    started = time.perf_counter()
    subprocess.run(argv, stdin=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def convert_copy(clip: torch.Tensor, pinned: bool) -> float:
    """Seconds for the worker's GPU converter to bring the whole clip to host staging."""
    from framewire.service._convert.staging import Staging
    from framewire.service._encode.encoder import Encoder
    from framewire.service._encode.pump import chunk_spans
    from framewire.service._sources.cuda_convert import CudaTensorSource, pin_host, unpin_host

    source = CudaTensorSource(clip)
    g = source.geometry
    per_chunk = Encoder().frames_per_chunk(g)
    frame_bytes = 3 * g.height * g.width
    writer = source.chunk_writer()
    with Staging(per_chunk * frame_bytes) as staging:
        address = staging.address()
        locked = pinned and pin_host(address, staging.size, clip.device)
        if pinned and not locked:
            raise SystemExit("the staging memfd could not be page-locked")
        writer.open(None, per_chunk)
        try:
            started = time.perf_counter()
            for i, (t0, t1) in enumerate(chunk_spans(g.frames, per_chunk)):
                nbytes = (t1 - t0) * frame_bytes
                writer.write(lambda i=i, n=nbytes: staging.slot(i % 2, n, punch=False), t0, t1)
            seconds = time.perf_counter() - started
        finally:
            writer.close()
            if locked:
                unpin_host(address, clip.device)
    return seconds


def naive(clip: torch.Tensor) -> tuple[float, float]:
    """(seconds, peak GPU MiB above the clip) of the whole-clip in-process conversion."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    u8 = (clip * 255).clamp(0, 255).to(torch.uint8)
    host = u8.permute(1, 2, 3, 0).cpu()
    seconds = time.perf_counter() - started
    peak = (torch.cuda.max_memory_allocated() - baseline) / MIB
    del u8, host
    torch.cuda.empty_cache()
    return seconds, peak


def worker_peak_mib(worker: Worker, device: torch.device) -> float:
    from framewire.client import Client
    from framewire.core.wire import normalize_uuid

    mine = normalize_uuid(torch.cuda.get_device_properties(device).uuid)
    with Client(worker.url) as c:
        devices = c.info()["cuda"]["devices"]
    [entry] = [d for d in devices if d["uuid"] == mine]
    return float(entry["max_memory_allocated"]) / MIB


def bench_length(frames: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from framewire.client import Client
    from framewire.core.media.argv import x264_auto_threads
    from framewire.service._encode.encoder import sha256_file

    device = torch.device("cuda", torch.cuda.current_device())
    threads = x264_auto_threads(args.height)
    print(f"{frames} frames: making the clip ...", file=sys.stderr, flush=True)
    clip = make_clip(frames, args.height, args.width, device)
    rgb = work / f"clip-{frames}.rgb"
    write_rgb(clip, rgb)
    torch.cuda.synchronize()
    row: dict[str, Any] = {"frames": frames, "threads": threads}
    worker = Worker(work / f"worker-{frames}")
    try:
        bare, ours, shas = [], [], set()
        for rep in range(args.repeat):
            print(f"{frames} frames: run {rep + 1}/{args.repeat}", file=sys.stderr, flush=True)
            out = work / f"bare-{frames}.mp4"
            bare.append(bare_ffmpeg(rgb, out, frames, args, threads))
            shas.add(("bare", sha256_file(out)))
            out.unlink()
            with Client(worker.url) as c:
                started = time.perf_counter()
                result = c.save_video(clip, f"fw-{frames}.mp4", fps=FPS, threads=threads)
                ours.append(time.perf_counter() - started)
            if result.route != "stream":
                raise SystemExit(f"framewire took the {result.route} route")
            shas.add(("framewire", result.sha256))
            (worker.outputs / f"fw-{frames}.mp4").unlink()
        row["worker_peak_gpu_mib"] = worker_peak_mib(worker, device)
    finally:
        worker.stop()
        rgb.unlink(missing_ok=True)
    row |= {
        "bare_wall_s": statistics.median(bare),
        "framewire_wall_s": statistics.median(ours),
        "same_bytes": len({sha for _, sha in shas}) == 1,
    }
    row["x_bare"] = row["framewire_wall_s"] / row["bare_wall_s"]
    in_bytes, out_bytes = clip.numel() * clip.element_size(), clip.numel()
    convert_copy(clip, pinned=True)  # warm-up: kernels and first-touch of the staging
    for kind, pinned in (("pinned", True), ("pageable", False)):
        seconds = min(convert_copy(clip, pinned) for _ in range(args.repeat))
        row[f"convert_{kind}_in_gbs"] = in_bytes / seconds / 1e9
        row[f"convert_{kind}_out_gbs"] = out_bytes / seconds / 1e9
    row["naive_s"], row["naive_peak_gpu_mib"] = naive(clip)
    del clip
    torch.cuda.empty_cache()
    return row


def report(rows: list[dict[str, Any]]) -> None:
    head = ("frames", "bare s", "framewire s", "x bare", "same bytes", "worker peak GPU MiB",
            "naive peak GPU MiB", "naive conv s", "conv+copy GB/s in (rgb out)")  # fmt: skip
    print("  ".join(head))
    for r in rows:
        cells = (
            str(r["frames"]).rjust(len(head[0])),
            f"{r['bare_wall_s']:.2f}".rjust(len(head[1])),
            f"{r['framewire_wall_s']:.2f}".rjust(len(head[2])),
            f"{r['x_bare']:.3f}x".rjust(len(head[3])),
            ("yes" if r["same_bytes"] else "NO").rjust(len(head[4])),
            f"{r['worker_peak_gpu_mib']:.0f}".rjust(len(head[5])),
            f"{r['naive_peak_gpu_mib']:.0f}".rjust(len(head[6])),
            f"{r['naive_s']:.3f}".rjust(len(head[7])),
            f"pinned {r['convert_pinned_in_gbs']:.1f} ({r['convert_pinned_out_gbs']:.1f}), "
            f"pageable {r['convert_pageable_in_gbs']:.1f} ({r['convert_pageable_out_gbs']:.1f})",
        )
        print("  ".join(cells))
    at = [r["x_bare"] for r in rows if r["frames"] == GOAL_WALL_FRAMES]
    if at:
        verdict = "PASS" if at[0] <= GOAL_WALL_RATIO else "MISS"
        got = f"{at[0]:.3f}x {verdict}"
    else:
        got = f"n/a ({GOAL_WALL_FRAMES} frames not measured)"
    goal = f"framewire wall <= {GOAL_WALL_RATIO:.2f}x bare at {GOAL_WALL_FRAMES} frames"
    print(f"goal: {goal}: {got}")
    peaks = ", ".join(f"{r['worker_peak_gpu_mib']:.0f} at {r['frames']}" for r in rows)
    print(f"worker peak GPU memory (flat in clip length is the point): {peaks} MiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=harness.count, nargs="+", default=[120, 240])
    parser.add_argument("--width", type=harness.count, default=1344)
    parser.add_argument("--height", type=harness.count, default=768)
    parser.add_argument("--repeat", type=harness.count, default=2, help="runs per variant (median)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_encode: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="framewire-gpubench-", dir="/dev/shm"))
    try:
        rows = [bench_length(frames, args, work) for frames in args.frames]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    name = torch.cuda.get_device_name()
    print(
        f"{args.width}x{args.height} float32 CTHW clip on {name}, {FPS} fps, x264 fast, "
        f"-threads {rows[0]['threads']} for both, {os.cpu_count()} CPUs, median of {args.repeat}"
    )
    report(rows)
    harness.write_json(args.json, rows)
    return 0 if all(r["same_bytes"] for r in rows) else 1


if __name__ == "__main__":
    harness.run(main)
