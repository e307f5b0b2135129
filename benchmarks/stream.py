"""Streaming benchmark: save a clip after generating it all, or stream it while it is made.

    .venv/bin/python benchmarks/stream.py [--frames 120] [--chunk 8] [--width 1344 --height 768]
                                          [--rates 1 0.5] [--ahead MIB] [--repeat 3]
                                          [--json OUT] [--figures DIR]

A producer process generates a float32 CTHW clip chunk by chunk at a steady
rate, as a VAE decoding in temporal chunks would, and hands it to one worker:

  (a) whole clip  every chunk copied into the clip, then one ``save_video`` of it
  (b) stream      ``open_video``; ``write`` each chunk as it is produced; ``close``
  (b0)            the same, through a second worker whose chunks are answered once
                  ffmpeg's pipe took them (``--stream-ahead-mib 0``), not once converted
  (c) in-process  no worker: the producer converts each chunk itself and writes
                  it into its own ffmpeg's stdin (the same argv), as an engine's
                  in-process chunked save does; its tail is x264's own floor
                  (the frames its lookahead and frame threads still hold)

The rate is set from the host: a calibration run times the worker encoding
the whole clip, and the producer then runs at ``--rates`` times that encoder frame
rate (its rate and half of it unless told; above 1, the producer outruns x264, as a
VAE does between its steps' pauses). Generating a chunk costs the producer one pass
over it (it adds a per-chunk offset to a fixed 8-frame pattern, in place, into its one output
buffer); the pacing sleeps out the rest of the chunk's time, so the host's
cores stay x264's, as with a VAE on a GPU.

Per run, in a producer process of its own (forked from one that imported the client):
  tail   last chunk produced -> the file is ready (the call returned)
  total  first frame started -> the file is ready
  wait   the producer's time inside ``write`` (held back by the worker's answers)
  extra  the producer's peak resident memory above its level once its
         generation buffers exist (VmHWM after resetting it through
         /proc/self/clear_refs: exact, no sampling), i.e. what saving costs it:
         (a) the whole clip, plus the shm segment save_video copies it into;
         (b) the writer's two staging segments.

Goals (DESIGN 8): (b)'s tail <= 0.25x (a)'s encode wall (the worker's
``encode_ms``: a little less than (a)'s tail, which adds the copy into shm and
the request), and (b)'s
extra <= 2 chunks + 32 MiB. (a) and (b) must give the same sha256. Beside the
table it draws each path's latency after the last chunk (stream-tail.png).
"""

from __future__ import annotations

import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
import numpy as np  # noqa: E402
import plots  # noqa: E402
from encode import clip_chunk  # noqa: E402  (the shared clip generator)

MIB = 1 << 20
FPS = 24
GOAL_TAIL_RATIO, GOAL_SLACK_MIB = 0.25, 32
MODES = {
    "a": "(a) whole clip",
    "b": "(b) stream",
    "b0": "(b) stream, answered once ffmpeg's pipe took the chunk",
    "c": "(c) in-process chunked pipe",
}


# ----------------------------------------------------------------------------- the producer


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def produce(spec: dict[str, Any]) -> dict[str, Any]:
    """One run in a process of its own: (a), (b) or (c) at ``spec["rate"]`` frames a second."""
    from framewire.client import Client

    frames, chunk, height, width = spec["frames"], spec["chunk"], spec["height"], spec["width"]
    mode = spec["mode"]
    pattern = clip_chunk(0, chunk, height, width)
    buffer = pattern.copy()  # the producer's one output buffer, reused per chunk (touched)
    interval = chunk / spec["rate"] if spec["rate"] else 0.0
    with Client(spec["url"], timeout=3600) as client:
        client.info()  # connected and warm before the clock starts
        whole = np.empty((3, frames, height, width), np.float32) if mode == "a" else None
        writer = client.open_video(spec["path"], fps=FPS) if mode.startswith("b") else None
        ffmpeg = in_process_ffmpeg(spec) if mode == "c" else None
        baseline_kib = status_kib("VmRSS:")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS: the peak from here on
        started = time.perf_counter()
        waited = 0.0
        for k, t0 in enumerate(range(0, frames, chunk)):
            n = min(chunk, frames - t0)
            out = buffer[:, :n]
            np.add(pattern[:, :n], np.float32(0.013 * k), out=out)  # generate the chunk
            np.remainder(out, np.float32(1.0), out=out)
            time.sleep(max(0.0, started + (k + 1) * interval - time.perf_counter()))
            produced = time.perf_counter()
            if writer is not None:
                writer.write(out)
                waited += time.perf_counter() - produced
            elif ffmpeg is not None:
                assert ffmpeg.stdin is not None
                ffmpeg.stdin.write(to_rgb24(out))
            else:
                assert whole is not None
                whole[:, t0 : t0 + n] = out
        if writer is not None:
            result = writer.close()
            digest, encode_s = result.sha256, result.timings.encode_ms / 1e3
        elif ffmpeg is not None:
            assert ffmpeg.stdin is not None
            ffmpeg.stdin.close()
            if ffmpeg.wait() != 0:
                raise RuntimeError("the in-process ffmpeg failed")
            digest, encode_s = hashlib.sha256(Path(spec["out"]).read_bytes()).hexdigest(), 0.0
        else:
            result = client.save_video(whole, spec["path"], fps=FPS)
            digest, encode_s = result.sha256, result.timings.encode_ms / 1e3
        ready = time.perf_counter()
    return {
        "mode": mode,
        "rate": spec["rate"],
        "tail_s": ready - produced,
        "total_s": ready - started,
        "wait_s": waited if writer is not None else 0.0,
        "extra_mib": (status_kib("VmHWM:") - baseline_kib) / 1024,
        "sha256": digest,
        "encode_s": encode_s,
    }


def in_process_ffmpeg(spec: dict[str, Any]) -> subprocess.Popen[bytes]:
    """The producer's own ffmpeg: the worker's argv, ``spec["threads"]`` or the thread
    count the worker would pick."""
    from framewire.core.media.argv import encode_argv, x264_auto_threads
    from framewire.core.media.process import resolve_ffmpeg

    h, w = spec["height"], spec["width"]
    threads = spec.get("threads") or x264_auto_threads(h)
    argv = encode_argv(resolve_ffmpeg(None), width=w, height=h, fps=FPS, output=spec["out"],
                       threads=threads, guard=False)  # fmt: skip
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stderr=subprocess.DEVNULL)


def to_rgb24(chunk: np.ndarray) -> bytes:
    """The standard conversion: (x * 255) clamped, truncated to uint8, as (t, H, W, 3)."""
    scaled = np.clip(chunk * np.float32(255), 0, 255).astype(np.uint8)
    return np.ascontiguousarray(scaled.transpose(1, 2, 3, 0)).tobytes()


def _producer(spec: dict[str, Any], conn: Connection) -> None:
    conn.send(produce(spec))


def run_producer(ctx: BaseContext, spec: dict[str, Any]) -> dict[str, Any]:
    """``produce(spec)`` in a process of its own, a rank's (harness.rank_context)."""
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(spec, theirs), daemon=True)
    proc.start()
    theirs.close()
    try:
        if not mine.poll(3600):
            raise RuntimeError("the producer took over an hour")
        return mine.recv()
    except EOFError:
        raise RuntimeError("the producer failed (its traceback is above)") from None
    finally:
        proc.join(30)


# ----------------------------------------------------------------------------- the table


def med(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def spread(rows: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in rows]
    m = statistics.median(values)
    if len(values) < 2 or m == 0:
        return ""
    return f" ±{100 * (max(values) - min(values)) / 2 / m:.0f}%"


def held(rows: list[dict[str, Any]]) -> str:
    if "wait_s" not in rows[0] or not rows[0]["mode"].startswith("b"):
        return "-"
    return f"{med(rows, 'wait_s'):.2f} s{spread(rows, 'wait_s')}"


def plot(
    runs: list[dict[str, Any]], rates: list[float], encoder_fps: float, directory: Path, note: str
) -> None:
    groups = [f"{rate:.1f} fps\n({rate / encoder_fps:.1f}x the encoder)" for rate in rates]
    tails = {
        name: [med([r for r in runs if r["rate"] == rate and r["mode"] == mode], "tail_s")
               for rate in rates]
        for mode, name in MODES.items()
    }  # fmt: skip
    encode_wall = med([r for r in runs if r["mode"] == "a"], "encode_s")
    title = "Last chunk produced -> file ready"
    with plots.figure(directory / "stream-tail.png", title, note=note) as [ax]:
        plots.bars(ax, groups, tails, ylabel="seconds (median)", xlabel="producer rate")
        plots.reference(
            ax,
            GOAL_TAIL_RATIO * encode_wall,
            f"goal: {GOAL_TAIL_RATIO}x the whole-clip encode of {encode_wall:.2f} s",
        )


def main() -> int:
    parser = harness.parser(__doc__, frames=120, width=1344, height=768, repeat=3)
    parser.add_argument("--chunk", type=harness.count, default=8)
    parser.add_argument(
        "--rates", type=float, nargs="+", default=[1.0, 0.5], help="x the encoder's frame rate"
    )
    parser.add_argument("--ahead", type=int, default=None, help="(b)'s --stream-ahead-mib")
    plots.add_option(parser)
    args = parser.parse_args()
    ctx = harness.rank_context("framewire.client")
    from tests.support.worker import start_worker

    chunk_mib = 3 * args.chunk * args.height * args.width * 4 / MIB
    goal_extra = 2 * chunk_mib + GOAL_SLACK_MIB
    with tempfile.TemporaryDirectory(prefix="framewire-stream-") as tmp:
        ahead = () if args.ahead is None else ("--stream-ahead-mib", str(args.ahead))
        worker = start_worker(Path(tmp) / "ahead", "--log-level", "warning", *ahead)
        paced = start_worker(Path(tmp) / "paced", "--log-level", "warning",
                             "--stream-ahead-mib", "0")  # fmt: skip
        try:
            base = {"url": worker.uds_url, "frames": args.frames, "chunk": args.chunk,
                    "height": args.height, "width": args.width}  # fmt: skip

            def one(mode: str, rate: float, i: int) -> dict[str, Any]:
                name = f"{mode}-{i}.mp4"
                w = paced if mode == "b0" else worker
                out = str(w.outputs / name)
                row = run_producer(ctx, base | {"url": w.uds_url, "mode": mode, "rate": rate,
                                                "path": name, "out": out})  # fmt: skip
                (w.outputs / name).unlink()
                return row

            calibration = one("a", 0, 0)
            encoder_fps = args.frames / calibration["encode_s"]
            rates = [encoder_fps * r for r in args.rates]
            runs = [one(mode, rate, i) for rate in rates for i in range(args.repeat)
                    for mode in MODES]  # fmt: skip
        finally:
            paced.stop()
            worker.stop()
    harness.write_json(args.json, {"encoder_fps": encoder_fps, "runs": runs})

    print(f"\n{args.frames} frames {args.width}x{args.height} float32 in chunks of {args.chunk} "
          f"({chunk_mib:.0f} MiB), {os.cpu_count()} CPUs; the worker encodes the whole clip "
          f"at {encoder_fps:.1f} fps (calibration: {calibration['encode_s']:.2f} s); "
          f"median of {args.repeat}, ± half the range")  # fmt: skip
    print(
        "| producer rate | path | last chunk -> file | / (a)'s encode wall | first frame -> file "
        "| producer held in write | producer extra memory |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    same = len({r["sha256"] for r in [calibration, *runs]}) == 1
    verdicts = []
    for rate in rates:
        by = {m: [r for r in runs if r["rate"] == rate and r["mode"] == m] for m in MODES}
        a, b = by["a"], by["b"]
        label = f"{rate:.1f} fps ({rate / encoder_fps:.1f}x the encoder)"
        encode_wall = med(a, "encode_s")
        ratio = med(b, "tail_s") / encode_wall
        for mode, rows in by.items():
            name = MODES[mode]
            vs = f"{med(rows, 'tail_s') / encode_wall:.2f}x"
            print(f"| {label} | {name} | {med(rows, 'tail_s'):.2f} s{spread(rows, 'tail_s')} "
                  f"| {vs} | {med(rows, 'total_s'):.2f} s{spread(rows, 'total_s')} "
                  f"| {held(rows)} | {med(rows, 'extra_mib'):.0f} MiB |")  # fmt: skip
        extra = max(r["extra_mib"] for r in b)
        verdicts.append(
            f"at {label}: tail {ratio:.2f}x (goal <= {GOAL_TAIL_RATIO}x) -> "
            f"{'PASS' if ratio <= GOAL_TAIL_RATIO else 'MISS'}; stream extra at most "
            f"{extra:.0f} MiB (goal <= {goal_extra:.0f} MiB) -> "
            f"{'PASS' if extra <= goal_extra else 'MISS'}"
        )
    print("\n".join(verdicts))
    print(f"same bytes (a), (b) and (c), every run: {same}")
    blocked = {m: med([r for r in runs if r["mode"] == m], "wait_s") for m in ("b", "b0")}
    print(f"producer held in write, all rates: {blocked['b']:.2f} s answered once converted, "
          f"{blocked['b0']:.2f} s once ffmpeg's pipe took the chunk")  # fmt: skip
    note = (f"{args.frames} frames {args.width}x{args.height} float32 in chunks of {args.chunk}; "
            f"median of {args.repeat}")  # fmt: skip
    plot(runs, rates, encoder_fps, args.figures, note)
    return 0 if same else 1


if __name__ == "__main__":
    harness.run(main)
