"""SGLang's save and decode functions, through the worker: the AROUND hooks that
:mod:`framewire.integrations.sglang` registers with SGLang's hook registry.

Each hook is called with SGLang's original function and its arguments. It routes the
save when framewire gives SGLang's bytes (SGLang's own encoder, asked by identity, the
x264 thread count SGLang's process would use, the ``sglang`` profile), and otherwise
runs the original (:func:`route`). What the hooks read of SGLang's ``utils`` is
probed before they are registered.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, get_args

import numpy as np
from framewire.client import OutputResult, ffmpeg_identity
from framewire.client.distributed import decode_reference_shared
from framewire.client.wire import Preset
from framewire.integrations._route import failed, route
from framewire.integrations._switch import Declined
from framewire.integrations._worker import WORKER, checked, save_tensors, write_frames

UTILS = "sglang.multimodal_gen.runtime.entrypoints.utils"
H3_REFERENCE = (
    "sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages"
    ".minimax_h3.reference_encoding"
)
PARALLEL_STATE = "sglang.multimodal_gen.runtime.distributed.parallel_state"
PRESETS = get_args(Preset)  # x264's, as the worker takes them
FLOATS = ("torch.float32", "torch.float16", "torch.bfloat16")
log = logging.getLogger("framewire.integrations")


def _utils() -> ModuleType:
    return sys.modules.get(UTILS) or importlib.import_module(UTILS)


def _identity() -> str:
    """The encoder SGLang's own save would run (its pinned imageio-ffmpeg's binary)."""
    return ffmpeg_identity(_utils()._resolve_ffmpeg_exe())


def _video(sample: Any) -> tuple[Any, Any]:
    """The (3, T, H, W) float tensor of an output, and its audio; Declined otherwise."""
    video, audio = _utils()._split_sample_audio(sample)
    if type(video).__module__ != "torch" or type(video).__name__ != "Tensor":
        raise Declined("the frames are not a torch tensor")
    if video.dim() not in (3, 4) or int(video.shape[0]) != 3:
        raise Declined("the tensor is not (3, T, H, W)")
    if str(video.dtype) not in FLOATS:
        raise Declined(f"frames of {video.dtype}")  # SGLang scales uint8 by 255 too: it wraps
    return (video.unsqueeze(1) if video.dim() == 3 else video), audio


def _dims(video: Any) -> tuple[int, int]:
    """Frames and height of a (3, T, H, W) tensor."""
    return int(video.shape[1]), int(video.shape[-2])


def _checked(path: str, quality: float, preset: str | None, fps: float) -> None:
    if os.path.splitext(path)[1].lower() != ".mp4":
        raise Declined("not an .mp4 output")
    if not 1 <= quality <= 10:
        raise Declined("quality outside 1..10")  # SGLang refuses it itself
    if preset is not None and preset not in PRESETS:
        raise Declined(f"x264 preset {preset!r}")
    if not fps >= 0.005:  # SGLang writes f"{fps:.02f}": below, a rate of 0.00
        raise Declined(f"fps {fps}")


def _options(
    frames: int,
    height: int,
    audio: Any,
    fps: float,
    sample_rate: Any,
    quality: float,
    preset: str | None,
) -> dict[str, Any]:
    """What SGLang's save of ``frames`` frames ``height`` tall would do, as framewire's
    save options."""
    utils = _utils()
    options: dict[str, Any] = {
        "fps": fps,
        "quality": quality,
        "preset": preset,
        # SGLang's own count in SGLang's process: x264's bytes depend on it.
        "threads": utils._x264_auto_thread_count(height),
        "profile": "sglang",
        "encoder": _identity(),
    }
    if audio is not None:
        samples = utils._normalize_audio_to_numpy(audio)
        if samples is None:
            raise Declined("audio of a type SGLang does not mux")
        options["audio"] = samples
        options["audio_sample_rate"] = utils._pick_audio_sample_rate(
            audio_np=samples, audio_sample_rate=sample_rate, fps=fps, num_frames=frames
        )
    return options


def _quality(output_compression: Any) -> float:
    return output_compression / 10 if output_compression is not None else 5


def save_direct(original: Callable[..., bool], *args: Any, **kw: Any) -> bool:
    """AROUND ``_try_save_cuda_video_direct``: True once the worker wrote the file."""

    def routed() -> bool:
        if args:
            raise Declined("positional arguments")  # keyword-only in every version verified
        path, quality = kw["save_file_path"], _quality(kw.get("output_compression"))
        preset = kw.get("x264_preset")  # 0.5.21 has none: its preset is always fast
        _checked(path, quality, preset, kw["fps"])
        video, audio = _video(kw["sample"])
        rate = kw.get("audio_sample_rate")
        options = _options(*_dims(video), audio, kw["fps"], rate, quality, preset)
        save_tensors([WORKER.target(path)], [video], options)
        return True

    return route("sglang", routed, original, args, kw)


def save_parallel(original: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """AROUND ``_try_save_cuda_videos_direct``: all outputs in one request."""

    def routed() -> list[bool]:
        samples, paths = _bind(args, kw, ("samples", "save_file_paths"))
        if len(samples) < 2 or len(samples) != len(paths):
            raise Declined("not several outputs")
        quality, preset = _quality(kw.get("output_compression")), kw.get("x264_preset")
        each = []
        for sample, path in zip(samples, paths, strict=True):
            _checked(path, quality, preset, kw["fps"])
            video, audio = _video(sample)
            rate = kw.get("audio_sample_rate")
            each.append((video, _options(*_dims(video), audio, kw["fps"], rate, quality, preset)))
        shared = {k: v for k, v in each[0][1].items() if k != "audio"}
        if any({k: v for k, v in o.items() if k != "audio"} != shared for _, o in each):
            raise Declined("outputs of different sizes or audio rates")
        audios = [o.get("audio") for _, o in each]
        targets = [WORKER.target(p) for p in paths]
        save_tensors(targets, [v for v, _ in each], shared, audios)
        return [True] * len(samples)

    return route("sglang", routed, original, args, kw)


def save_frames(original: Callable[..., None], *args: Any, **kw: Any) -> None:
    """AROUND ``_save_video_ffmpeg``: frames SGLang materialized (uint8 (H, W, 3))."""

    def routed() -> None:
        path, frames = _bind(args, kw, ("save_file_path", "frames"))
        if kw.get("audio_path") is not None:
            raise Declined("audio from a WAV file")
        _checked(path, kw["quality"], kw.get("x264_preset"), kw["fps"])
        first = np.asarray(frames[0]) if len(frames) else None
        if first is None or first.ndim != 3 or first.shape[2] != 3:
            raise Declined("frames that are not RGB")
        if any(np.asarray(f).dtype != np.uint8 or np.shape(f) != first.shape for f in frames):
            raise Declined("frames of other shapes or dtypes")  # SGLang refuses them itself
        threads = _utils()._x264_auto_thread_count(first.shape[0])
        options = {"fps": kw["fps"], "quality": kw["quality"], "preset": kw.get("x264_preset")}
        write_frames(
            WORKER.target(path),
            frames,
            threads=threads,
            profile="sglang",
            encoder=_identity(),
            **options,
        )

    return route("sglang", routed, original, args, kw)


class StreamedEncoder:
    """SGLang's ``CudaVideoEncoder`` (``write``, ``close``, ``abort``, ``save_file_path``)
    as a worker stream session: each [3, t, H, W] chunk handed over while the VAE decodes
    the next (CUDA chunks over CUDA IPC), the file SGLang's encoder would write.

    Its failures are raised as SGLang's own encoder raises them (a RuntimeError, its
    message cleaned): SGLang then saves the frames after the decode instead."""

    def __init__(self, save_file_path: str, target: str, options: dict[str, Any]):
        self.save_file_path = save_file_path
        self._target = target
        self._writer = WORKER.client().open_video(target, **options, layout="CTHW")

    def write(self, frames: Any) -> None:
        try:
            self._writer.write(frames.unsqueeze(1) if frames.dim() == 3 else frames)
        except Exception as exc:
            raise failed("sglang", exc) from None

    def close(self) -> None:
        try:
            result: OutputResult = self._writer.close()
            checked(self._target, result)
        except Exception as exc:
            raise failed("sglang", exc) from None

    def abort(self) -> None:
        """Stop the session and remove what is at the path, as SGLang's ``abort`` does."""
        with contextlib.suppress(Exception):
            self._writer.abort()
        with contextlib.suppress(OSError):
            os.remove(self.save_file_path)


def open_streamed(original: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """AROUND ``CudaVideoEncoder.open`` (encode while decoding, CUDA frames): a
    :class:`StreamedEncoder`, else SGLang's own encoder (or its None: not this path)."""

    def routed() -> StreamedEncoder:
        _cls, path = _bind(args, kw, ("cls", "save_file_path"))
        if getattr(kw["device"], "type", None) != "cuda":
            raise Declined("frames not on a CUDA device")  # SGLang's own answer: None
        quality = _quality(kw.get("output_compression"))
        _checked(path, quality, kw.get("x264_preset"), kw["fps"])
        options = _options(
            kw["num_frames"],
            kw["height"],
            kw.get("audio"),
            kw["fps"],
            kw.get("audio_sample_rate"),
            quality,
            kw.get("x264_preset"),
        )
        return StreamedEncoder(path, WORKER.target(path), options)

    return route("sglang", routed, original, args, kw)


def decode_reference_frames(original: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """AROUND MiniMax-H3's ``minimax_h3_decode_reference_video_frames``: the worker's
    decode (once per host, the same command), a writable (T, H, W, 3) uint8 array as
    SGLang's. Shared across the replica group in one collective round: every rank gets
    the frames, or every rank runs SGLang's own decode (which has its own rounds)."""

    def routed() -> Any:
        [path] = _bind(args, kw, ("video_path",))
        width, height = kw["target_width"], kw["target_height"]
        count, fps = kw["target_frame_count"], float(kw.get("fps", 24))
        start = float(kw.get("start_time_seconds", 0.0))
        if min(width, height, count) <= 0 or not fps > 0 or not start >= 0:
            raise Declined("arguments SGLang refuses")  # its own error, from its own code
        exe = shutil.which("ffmpeg")  # SGLang decodes with the ffmpeg on PATH
        if exe is None:
            raise Declined("no ffmpeg on PATH")
        asked = {
            "fps": fps,
            "width": width,
            "height": height,
            "start": start,
            "max_frames": count,
            "decoder": ffmpeg_identity(exe),
        }
        group = importlib.import_module(PARALLEL_STATE).get_replica_group()
        if kw.get("share_across_replicas") and group.world_size > 1:
            frames = decode_reference_shared(
                path, group=group.cpu_group, client=WORKER.client(), local_fallback=False, **asked
            )
        else:
            frames = WORKER.client().decode_reference(path, local_fallback=False, **asked)
        with frames:  # the writable view is a private mapping of its own
            return frames.writable()

    return route("sglang", routed, original, args, kw)


def _bind(args: Sequence[Any], kw: dict[str, Any], names: tuple[str, ...]) -> list[Any]:
    """The leading parameters ``names``, given by position or keyword."""
    return [args[i] if i < len(args) else kw[name] for i, name in enumerate(names)]
