"""SGLang (``sglang.multimodal_gen`` 0.5.23) saves its videos through the worker.

Loaded by SGLang's own plugin loader (entry point ``framewire`` of the group
``sglang.multimodal_gen.plugins``, so ``SGLANG_PLUGINS``, when set, must name
it) and acting only when ``FRAMEWIRE_INTEGRATIONS`` names ``sglang``. It
registers AROUND hooks with SGLang's hook registry on three functions of
``runtime/entrypoints/utils.py``:

- ``_try_save_cuda_video_direct``: every tensor save (CPU or CUDA), before the
  engine would materialize a CPU tensor's frames: True once the worker wrote it;
- ``_try_save_cuda_videos_direct``: several outputs of one request, encoded in
  parallel under the worker's admission;
- ``_save_video_ffmpeg``: frames the engine materialized (upscaling, frame
  interpolation, frames handed back), without audio.

Each routed save asks for SGLang's own encoder (the binary its
``_resolve_ffmpeg_exe`` names) with the ``sglang`` profile, and the x264 thread
count SGLang's process would use. Whatever framewire does not reproduce (another
container, uint8 or float64 tensors, a quality outside 1..10, an unknown preset,
a path outside the worker's roots) and any save the worker cannot take run
SGLang's original function.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np
from framewire.client import ffmpeg_identity
from framewire.client.distributed import decode_reference_shared
from framewire.integrations._route import (
    WORKER,
    Declined,
    enabled,
    route,
    save_tensors,
    say_once,
    write_frames,
)

UTILS = "sglang.multimodal_gen.runtime.entrypoints.utils"
PLUGINS = "sglang.multimodal_gen.runtime.platforms.plugins"
PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower",
           "veryslow", "placebo")  # fmt: skip
FLOATS = ("torch.float32", "torch.float16", "torch.bfloat16")
CHECK_S = 600.0  # how long the check waits for SGLang to apply the hooks
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


def _options(frames: int, height: int, audio: Any, fps: float, sample_rate: Any,
             quality: float, preset: str | None) -> dict[str, Any]:  # fmt: skip
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
            audio_np=samples, audio_sample_rate=sample_rate, fps=fps,
            num_frames=frames,
        )  # fmt: skip
    return options


def _quality(output_compression: Any) -> float:
    return output_compression / 10 if output_compression is not None else 5


def save_direct(original: Callable[..., bool], *args: Any, **kw: Any) -> bool:
    """AROUND ``_try_save_cuda_video_direct``: True once the worker wrote the file."""

    def routed() -> bool:
        if args:
            raise Declined("positional arguments")  # keyword-only in SGLang 0.5.23
        path, quality = kw["save_file_path"], _quality(kw.get("output_compression"))
        _checked(path, quality, kw.get("x264_preset"), kw["fps"])
        video, audio = _video(kw["sample"])
        options = _options(*_dims(video), audio, kw["fps"], kw.get("audio_sample_rate"),
                           quality, kw.get("x264_preset"))  # fmt: skip
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
        write_frames(WORKER.target(path), frames, fps=kw["fps"], quality=kw["quality"],
                     preset=kw.get("x264_preset"), threads=threads, profile="sglang",
                     encoder=_identity())  # fmt: skip

    return route("sglang", routed, original, args, kw)


class StreamedEncoder:
    """SGLang's ``CudaVideoEncoder`` (``write``, ``close``, ``abort``, ``save_file_path``)
    as a worker stream session: each [3, t, H, W] chunk handed over while the VAE decodes
    the next (CUDA chunks over CUDA IPC), the file SGLang's encoder would write."""

    def __init__(self, save_file_path: str, target: str, options: dict[str, Any]):
        self.save_file_path = save_file_path
        self._writer = WORKER.client().open_video(target, **options, layout="CTHW")

    def write(self, frames: Any) -> None:
        self._writer.write(frames.unsqueeze(1) if frames.dim() == 3 else frames)

    def close(self) -> None:
        self._writer.close()

    def abort(self) -> None:
        self._writer.abort()


def open_streamed(original: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """AROUND ``CudaVideoEncoder.open`` (encode while decoding, CUDA frames): a
    :class:`StreamedEncoder`, else SGLang's own encoder (or its None: not this path)."""

    def routed() -> StreamedEncoder:
        _cls, path = _bind(args, kw, ("cls", "save_file_path"))
        if getattr(kw["device"], "type", None) != "cuda":
            raise Declined("frames not on a CUDA device")  # SGLang's own answer: None
        quality = _quality(kw.get("output_compression"))
        _checked(path, quality, kw.get("x264_preset"), kw["fps"])
        options = _options(kw["num_frames"], kw["height"], kw.get("audio"), kw["fps"],
                           kw.get("audio_sample_rate"), quality, kw.get("x264_preset"))  # fmt: skip
        return StreamedEncoder(path, WORKER.target(path), options)

    return route("sglang", routed, original, args, kw)


H3 = "sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.minimax_h3"
H3_REFERENCE = f"{H3}.reference_encoding"
PARALLEL_STATE = "sglang.multimodal_gen.runtime.distributed.parallel_state"


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
        asked = {"fps": fps, "width": width, "height": height, "start": start,
                 "max_frames": count, "decoder": ffmpeg_identity(exe)}  # fmt: skip
        group = importlib.import_module(PARALLEL_STATE).get_replica_group()
        if kw.get("share_across_replicas") and group.world_size > 1:
            frames = decode_reference_shared(path, group=group.cpu_group, client=WORKER.client(),
                                             local_fallback=False, **asked)  # fmt: skip
        else:
            frames = WORKER.client().decode_reference(path, local_fallback=False, **asked)
        with frames:  # the writable view is a private mapping of its own
            return frames.writable()

    return route("sglang", routed, original, args, kw)


def _bind(args: Sequence[Any], kw: dict[str, Any], names: tuple[str, ...]) -> list[Any]:
    """The leading parameters ``names``, given by position or keyword."""
    return [args[i] if i < len(args) else kw[name] for i, name in enumerate(names)]


HOOKS = {
    "_try_save_cuda_video_direct": save_direct,
    "_try_save_cuda_videos_direct": save_parallel,
    "_save_video_ffmpeg": save_frames,
    "CudaVideoEncoder.open": open_streamed,
}
# Other modules of SGLang's with a save or decode framewire takes over: module -> {name: hook}.
MORE_HOOKS = {H3_REFERENCE: {"minimax_h3_decode_reference_video_frames": decode_reference_frames}}


def register() -> None:
    """The plugin's entry point: SGLang's ``load_plugins()`` calls it in every process.
    Registers nothing unless ``FRAMEWIRE_INTEGRATIONS`` names ``sglang``."""
    if not enabled("sglang"):
        return
    plugins = importlib.import_module(PLUGINS)
    for module, hooks in [(UTILS, HOOKS), *MORE_HOOKS.items()]:
        for name, hook in hooks.items():
            plugins.HookRegistry.register(f"{module}.{name}", hook, plugins.HookType.AROUND)
    threading.Thread(target=_check_later, name="framewire-sglang-check", daemon=True).start()


def hooked() -> dict[str, bool]:
    """Whether each function of SGLang's ``utils`` is bound to framewire's hook now."""
    found = {}
    for module, hooks in [(UTILS, HOOKS), *MORE_HOOKS.items()]:
        loaded = sys.modules.get(module)
        found.update({name: loaded is not None and _wraps(_attr(loaded, name), hook)
                      for name, hook in hooks.items()})  # fmt: skip
    return found


def _attr(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "__func__", obj)  # a classmethod: its function


def _wraps(fn: Any, hook: Callable[..., Any]) -> bool:
    while fn is not None:  # the registry's wrappers close over their hook
        if any(getattr(c, "cell_contents", None) is hook for c in fn.__closure__ or ()):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def check() -> dict[str, bool]:
    """Log which saves are routed (once), or which hooks did not take (SGLang only logs a
    hook that fails to apply)."""
    found = hooked()
    if not enabled("sglang"):
        return found
    routed = [n for n, ok in found.items() if ok]
    missing = [n for n, ok in found.items() if not ok]
    url = os.environ.get("FRAMEWIRE_URL") or "the default address"
    if routed:
        say_once("sglang:routes", "framewire: SGLang's %s save through the worker at %s; "
                 "every other save runs SGLang's own code", ", ".join(routed), url)  # fmt: skip
    if missing:
        say_once("sglang:missing", "framewire: the hooks on SGLang's %s did not take: "
                 "those saves run SGLang's own code", ", ".join(missing),
                 level=logging.ERROR)  # fmt: skip
    return found


def _check_later() -> None:
    """Wait (bounded) for SGLang to apply its plugins' hooks in this process, then check."""
    deadline = time.monotonic() + CHECK_S
    while time.monotonic() < deadline:
        plugins = sys.modules.get(PLUGINS)
        state = getattr(getattr(plugins, "_hook_application", None), "state", None)
        if getattr(state, "name", None) in ("COMPLETE", "FAILED"):
            check()
            return
        time.sleep(0.2)
