"""Validating outputs: one probe process per file, against framewire's in-process check.

    .venv/bin/python benchmarks/validate.py [--outputs 4] [--frames 120] [--repeat 20]

Encodes the clip of benchmarks/encode.py (moving gradients and a little noise,
1344x768, --frames frames, x264 fast as outputs are) once and copies the MP4
--outputs times. Then, median of --repeat rounds:

  probe processes   one `ffprobe -show_streams -show_format` per file (MP4's
                    nb_frames comes from its index), the way the in-process save
                    path checked its outputs, serially and 4 at a time (ffprobe
                    from PATH; where there is none, `ffmpeg -i FILE` of the same
                    binary stands in: a process start and a probe per file)
  framewire, serial validate_output per file, one after another: PyAV in this
                    process (frames from the MP4 index; opening the file decodes
                    the first frame), then size, rate, audio and duration compared
  framewire, as the worker runs them
                    the same, one thread per output, as the outputs of one
                    request are validated (PyAV releases the GIL meanwhile)

Goal (benchmarks/README.md): validating 4 outputs in <= 10 ms.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import harness
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from encode import GEN_CHUNK, clip_chunk  # noqa: E402  (the shared clip)
from framewire.core.media.process import resolve_ffmpeg  # noqa: E402
from framewire.service._encode.encoder import EncodeParams, Encoder  # noqa: E402
from framewire.service._encode.validate import validate_output  # noqa: E402
from framewire.service._sources.frames import TensorSource  # noqa: E402

WIDTH, HEIGHT, FPS = 1344, 768, 24
GOAL_MS, GOAL_OUTPUTS = 10.0, 4


def make_outputs(directory: Path, count: int, frames: int) -> list[Path]:
    steps = range(0, frames, GEN_CHUNK)
    clip = np.concatenate(
        [clip_chunk(t, min(t + GEN_CHUNK, frames), HEIGHT, WIDTH) for t in steps], axis=1
    )
    first = directory / "out0.mp4"
    Encoder(resolve_ffmpeg()).encode(TensorSource(clip), first, EncodeParams(fps=FPS))
    paths = [first]
    for i in range(1, count):
        paths.append(directory / f"out{i}.mp4")
        shutil.copyfile(first, paths[-1])
    return paths


def probe_command(ffmpeg: str) -> tuple[str, list[str]]:
    ffprobe = shutil.which("ffprobe")
    if ffprobe:
        argv = [ffprobe, "-v", "error", "-show_streams", "-show_format", "-of", "json"]
        return "ffprobe", argv
    return "ffmpeg -i", [ffmpeg, "-hide_banner", "-i"]


def median_ms(fn: Callable[[], None], repeat: int) -> float:
    fn()  # warm: the page cache, the binary, PyAV's libraries
    return statistics.median(harness.timed_ms(lambda _: fn(), repeat))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--outputs", type=harness.count, default=GOAL_OUTPUTS)
    parser.add_argument("--frames", type=harness.count, default=120)
    parser.add_argument("--repeat", type=harness.count, default=20)
    args = parser.parse_args()
    ffmpeg = resolve_ffmpeg()
    peer, argv = probe_command(ffmpeg)
    with tempfile.TemporaryDirectory(prefix="framewire-validate-") as tmp:
        paths = make_outputs(Path(tmp), args.outputs, args.frames)

        def process(path: Path) -> None:
            # `ffmpeg -i` with no output exits 1 after probing: that is its answer.
            subprocess.run([*argv, str(path)], capture_output=True, check=peer == "ffprobe")

        def processes() -> None:
            for path in paths:
                process(path)

        def processes_4() -> None:
            with ThreadPoolExecutor(min(4, len(paths))) as pool:
                list(pool.map(process, paths))

        def check(path: Path) -> None:
            validate_output(
                path, frames=args.frames, width=WIDTH, height=HEIGHT, fps=FPS, audio=False
            )

        def serial() -> None:
            for path in paths:
                check(path)

        def threaded() -> None:
            with ThreadPoolExecutor(len(paths)) as pool:
                list(pool.map(check, paths))

        rows = [
            (f"{peer} processes, serial", median_ms(processes, args.repeat)),
            (f"{peer} processes, 4 at a time", median_ms(processes_4, args.repeat)),
            ("framewire, serial", median_ms(serial, args.repeat)),
            ("framewire, a thread per output", median_ms(threaded, args.repeat)),
        ]
    cpus = len(os.sched_getaffinity(0))
    print(f"\nvalidating {args.outputs} outputs of {WIDTH}x{HEIGHT}, {args.frames} frames, "
          f"{cpus} CPUs, median of {args.repeat}")  # fmt: skip
    print(f"| {'how':<32} | total ms | per output ms | vs processes |")
    print(f"|{'-' * 34}|----------|---------------|--------------|")
    for name, ms in rows:
        print(f"| {name:<32} | {ms:8.2f} | {ms / args.outputs:13.2f} | "
              f"{ms / rows[0][1]:11.2f}x |")  # fmt: skip
    if args.outputs == GOAL_OUTPUTS:
        for name, ms in rows[2:]:
            verdict = "PASS" if ms <= GOAL_MS else "MISS"
            print(f"goal: {GOAL_OUTPUTS} outputs in <= {GOAL_MS:g} ms, {name} -> {verdict} "
                  f"({ms:.2f} ms)")  # fmt: skip
    return 0


if __name__ == "__main__":
    harness.run(main)
