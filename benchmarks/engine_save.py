"""One engine save, timed, in the engine's own environment (run by benchmarks/engines.py).

    python benchmarks/engine_save.py ENGINE OUT FRAMES WIDTH HEIGHT [SAVES GAP_S]

Makes the clip first (not timed, not counted), saves a tiny clip once to warm the
process up as a serving engine is (imports, the client's connection, the encoder's
identity: paid once per process, not per save), waits SETTLE_S, as a serving engine's
next save comes only after its next generation (what the warm-up set going in the
background, the worker's next PyAV writer, is ready by then; the same wait whether the
integration is on or off), then runs the engine's own save
function once (SGLang's ``save_outputs``, vLLM-omni's ``ChunkedVideoMP4Session``, its
``ChunkedMP4Encoder`` fed uint8 chunks and its one-shot ``_encode_video_bytes``,
diffusers' ``export_to_video``; framewire's
integration on or off as the
environment says) and prints one JSON line: wall seconds, the CPU seconds of the
process and of the children it waited for (an engine's own ffmpeg; not the worker's),
the process's peak resident memory above its level before the save (VmHWM, reset
first), sha256. With SAVES (benchmarks/back_to_back.py): that many timed saves of the
clip, each GAP_S seconds after the one before was hashed (a few ms: 0 is back to back);
each one's wall, their median, the CPU per save, the peak over all of them, and the
sha256 they share.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from framewire.integrations import enabled


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _clip(frames: int, width: int, height: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.rand(3, frames, height, width, generator=g)


def _sglang(clip: Any, out: Path) -> None:
    from tests.support.engine_sglang import TASK_TYPE, enter_sglang

    if "sglang" not in sys.modules:
        enter_sglang()
    plugins = importlib.import_module("sglang.multimodal_gen.runtime.platforms.plugins")
    plugins.load_plugins()
    plugins.apply_plugin_hooks()
    utils = importlib.import_module("sglang.multimodal_gen.runtime.entrypoints.utils")
    video = importlib.import_module(TASK_TYPE).DataType.VIDEO
    _timed(lambda: utils.save_outputs([clip], video, 24, True,
                                             lambda i: str(out)), out)  # fmt: skip


# vLLM-omni's serving default: x264's ultrafast, its own thread count.
VLLM_OMNI_OPTIONS = {"preset": "ultrafast", "threads": "0"}


def _vllm_omni_module(name: str) -> Any:
    """vLLM-omni's module ``name``, its environment entered and its plugins loaded."""
    from tests.support.engine_vllm_omni import enter_vllm_omni

    if "vllm" not in sys.modules:
        enter_vllm_omni()
    importlib.import_module("vllm_omni.plugins").load_omni_general_plugins()
    return importlib.import_module(name)


def _vllm_omni(clip: Any, out: Path) -> None:
    from tests.support.engine_vllm_omni import CHUNKED

    chunked = _vllm_omni_module(CHUNKED)
    batch = clip.unsqueeze(0) * 2 - 1  # a Wan VAE's (-1, 1), made before the timing

    def save() -> None:
        session = chunked.ChunkedVideoMP4Session(
            value_range=(-1.0, 1.0), fps=24,
            video_codec_options=VLLM_OMNI_OPTIONS,
        )  # fmt: skip
        for t0 in range(0, batch.shape[2], 8):  # the VAE's chunks
            session.push(batch[:, :, t0 : t0 + 8])
        out.write_bytes(session.finish()[0])

    _timed(save, out)


def _vllm_omni_encoder(clip: Any, out: Path) -> None:
    import torch

    from tests.support.engine_vllm_omni import CHUNKED

    chunked = _vllm_omni_module(CHUNKED)
    # The (T, H, W, 3) uint8 chunks vLLM-omni's session hands its encoder once it has
    # quantized them (on a GPU host, on the GPU): made before the timing.
    frames = (clip.permute(1, 2, 3, 0) * 255).round().to(torch.uint8).numpy()
    chunks = [frames[t0 : t0 + 8].copy() for t0 in range(0, len(frames), 8)]

    def save() -> None:
        height, width = frames.shape[1:3]
        encoder = chunked.ChunkedMP4Encoder(
            width=width, height=height, fps=24, video_codec_options=VLLM_OMNI_OPTIONS
        )
        for chunk in chunks:
            encoder.push(chunk)
        out.write_bytes(encoder.finish())

    _timed(save, out)


def _vllm_omni_bytes(clip: Any, out: Path) -> None:
    from tests.support.engine_vllm_omni import API

    api = _vllm_omni_module(API)
    frames = clip.permute(1, 2, 3, 0).contiguous().numpy()  # (T, H, W, 3) float32 in [0, 1]

    def save() -> None:
        out.write_bytes(
            api._encode_video_bytes(frames, fps=24, video_codec_options=VLLM_OMNI_OPTIONS)
        )

    _timed(save, out)


def _diffusers(clip: Any, out: Path) -> None:
    frames = list(clip.permute(1, 2, 3, 0).contiguous().numpy())  # a pipeline's np output
    if enabled("diffusers"):  # the drop-in: the import is the opt-in
        from framewire.integrations.diffusers import export_to_video
    else:
        from diffusers.utils import export_to_video

    _timed(lambda: export_to_video(frames, str(out), fps=24), out)


def _cpu_s() -> float:
    """CPU seconds of this process and of its children waited for (an engine's ffmpeg)."""
    mine, theirs = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return mine.ru_utime + mine.ru_stime + theirs.ru_utime + theirs.ru_stime


WARMING = True  # the first save of a process is the warm-up: not timed
SETTLE_S = 1.0  # between the warm-up and the timed save
SAVES, GAP_S = 1, 0.0  # timed saves of the clip, one after another, this far apart


def _timed(save: Any, out: Path) -> None:
    global WARMING
    if WARMING:
        save()
        WARMING = False
        return
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    before, cpu = _status("VmRSS"), 0.0
    walls, digests = [], set()
    for n in range(SAVES):
        if n:
            time.sleep(GAP_S)
        t0, cpu0 = time.perf_counter(), _cpu_s()
        save()
        walls.append(time.perf_counter() - t0)
        cpu += (_cpu_s() - cpu0) / SAVES
        with out.open("rb") as f:  # a block at a time: the peak is the saves' own
            digests.add(hashlib.file_digest(f, "sha256").hexdigest())
    peak = max(0, _status("VmHWM") - before)
    figures = {"wall_s": statistics.median(walls), "cpu_s": cpu, "peak_extra_mib": peak / (1 << 20)}
    digest = digests.pop() if len(digests) == 1 else "saves differ"
    print(json.dumps({**figures, "walls": walls, "sha256": digest}))


def main() -> None:
    global SAVES, GAP_S
    engine, out = sys.argv[1], Path(sys.argv[2])
    frames, width, height = (int(a) for a in sys.argv[3:6])
    if len(sys.argv) > 6:  # benchmarks/back_to_back.py: several saves, GAP_S apart
        SAVES, GAP_S = int(sys.argv[6]), float(sys.argv[7])
    save = {"sglang": _sglang, "vllm-omni": _vllm_omni, "vllm-omni-encoder": _vllm_omni_encoder,
            "vllm-omni-bytes": _vllm_omni_bytes, "diffusers": _diffusers}[engine]  # fmt: skip
    clip = _clip(frames, width, height)
    warm = out.with_name("warm-" + out.name)
    save(_clip(8, 64, 48), warm)
    warm.unlink()
    time.sleep(SETTLE_S)
    save(clip, out)


if __name__ == "__main__":
    main()
