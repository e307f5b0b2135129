"""Each engine's own save function with framewire's integration off and on, side by side.

    .venv/bin/python benchmarks/engines.py [--frames 120] [--width 1344 --height 768]
                                           [--repeat 3] [--json OUT]

Per engine, its real save in its own environment and pins (tests/support/engine_site.py:
SGLang 0.5.23 with imageio-ffmpeg 0.5.1; vLLM-omni 0.30.0; diffusers 0.42.1 from the
test environment), one process per run (benchmarks/engine_save.py, forked from one
that has imported torch and numpy, PIL, httpx... in the engine's environment:
tests/support/zygote.py; FRAMEWIRE_TEST_FORK=0 starts each afresh), on a float32 clip
made before the timing:

  SGLang            save_outputs of a CPU (3, T, H, W) tensor (the engine materializes it)
  vLLM-omni         ChunkedVideoMP4Session, 8-frame chunks, ultrafast, threads 0
  vLLM-omni encoder ChunkedMP4Encoder fed the session's 8-frame uint8 chunks made
                    before the timing (as on a GPU host, whose session quantizes on
                    the GPU): the encode and the hand-over alone
  vLLM-omni bytes   _encode_video_bytes of (T, H, W, 3) float32 frames, ultrafast, threads 0
  diffusers         export_to_video of T float32 (H, W, 3) frames (the drop-in when on)

"off": the engine's own code (the plugin installed, not enabled); "on":
FRAMEWIRE_INTEGRATIONS names it, against one worker holding SGLang's ffmpeg, its encodes
yielding as it ships (niceness 19, SCHED_BATCH, each in a session of its own). Figures,
medians of --repeat runs (min..max beside): the save's wall, the calling process's
peak resident memory above its level before the save (the client's chunk buffers count
once mapped in it, from their first reuse: a buffer filled once would not show), and
whether every run's sha256 equals the engine's own. Goal (DESIGN 8): never slower; the
memory flat where the engine's grows with the frames. The worker runs on the same 2
cores: its CPU is the encode's, not extra.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402

from tests.support.cli import run_to_end, start_process  # noqa: E402
from tests.support.engine_site import engine_env, engine_ffmpeg, engine_site  # noqa: E402
from tests.support.worker import FORK, start_worker  # noqa: E402
from tests.support.zygote import torch_zygote  # noqa: E402

SAVE = HERE / "engine_save.py"

ENGINES = ("sglang", "vllm-omni", "vllm-omni-encoder", "vllm-omni-bytes", "diffusers")
SITES = {"vllm-omni-bytes": "vllm-omni", "vllm-omni-encoder": "vllm-omni"}  # its engine's site


def one(
    engine: str,
    on: bool,
    worker: Any,
    args: argparse.Namespace,
    n: int,
    saves: Sequence[str] = (),
) -> dict[str, Any]:
    """One run of engine_save.py (``saves``: its SAVES and GAP_S, back_to_back.py's)."""
    site = engine_site(SITES.get(engine, engine)) if engine != "diffusers" else None
    extra = {"VLLM_PLUGINS": "framewire"}  # vLLM-omni's own models' plugin needs vLLM
    if on:
        extra |= {"FRAMEWIRE_INTEGRATIONS": SITES.get(engine, engine),
                  "FRAMEWIRE_URL": worker.uds_url}  # fmt: skip
    env = engine_env(site, **extra) if site else {**os.environ, **extra}
    out = worker.outputs / f"{engine}-{'on' if on else 'off'}-{n}.mp4"
    given = [engine, str(out), str(args.frames), str(args.width), str(args.height), *saves]
    forks = torch_zygote(env) if FORK else None  # one per environment: torch imported once
    done = run_to_end([sys.executable, str(SAVE), *given], lambda stdio: start_process(
        [sys.executable, str(SAVE), *given], forks, given, stdio=stdio, env=env, cwd=REPO,
        script=SAVE,
    ), timeout=1800)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{engine} {'on' if on else 'off'} failed:\n{done.stderr[-3000:]}")
    out.unlink()
    return json.loads(done.stdout.splitlines()[-1])


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, default=120)
    p.add_argument("--width", type=int, default=1344)
    p.add_argument("--height", type=int, default=768)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    sglang_ffmpeg = engine_ffmpeg(engine_site("sglang"))
    with tempfile.TemporaryDirectory() as tmp:
        worker = start_worker(Path(tmp), "--encoders", str(sglang_ffmpeg), yielding=True)
        try:
            rows, runs = [], []
            for engine in args.engines:
                got: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
                for n in range(args.repeat):
                    for on in (False, True):  # interleaved: the host's drift hits both
                        got[on].append(one(engine, on, worker, args, n))
                runs += [{"engine": engine, "on": on, **r} for on in got for r in got[on]]
                shas = {r["sha256"] for r in got[False] + got[True]}
                off_wall = [r["wall_s"] for r in got[False]]
                on_wall = [r["wall_s"] for r in got[True]]
                rows.append({
                    "engine": engine,
                    "off_wall_s": statistics.median(off_wall),
                    "on_wall_s": statistics.median(on_wall),
                    "ratio": statistics.median(on_wall) / statistics.median(off_wall),
                    "off_peak_mib": statistics.median(r["peak_extra_mib"] for r in got[False]),
                    "on_peak_mib": statistics.median(r["peak_extra_mib"] for r in got[True]),
                    "same_bytes": len(shas) == 1,
                    "off_wall": spread(off_wall),
                    "on_wall": spread(on_wall),
                })  # fmt: skip
        finally:
            worker.stop()
    print(f"{args.frames} frames {args.width}x{args.height} float32, median of {args.repeat}"
          " (min..max)")  # fmt: skip
    print("| engine | off: wall s | on: wall s | on/off | off: peak MiB | on: peak MiB | "
          "sha256 equal |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        peaks = f"{r['off_peak_mib']:.0f} | {r['on_peak_mib']:.0f}"
        print(f"| {r['engine']} | {r['off_wall']} | {r['on_wall']} | {r['ratio']:.2f}x | "
              f"{peaks} | {r['same_bytes']} |")  # fmt: skip
    harness.write_json(args.json, {"rows": rows, "runs": runs})
    return 0 if all(r["same_bytes"] for r in rows) else 1


if __name__ == "__main__":
    harness.run(main)
