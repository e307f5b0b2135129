"""SGLang (``sglang.multimodal_gen``, 0.5.21 to 0.5.23) saves its videos through the worker.

Loaded by SGLang's own plugin loader (entry point ``framewire`` of the group
``sglang.multimodal_gen.plugins``, so ``SGLANG_PLUGINS``, when set, must name
it) and acting only when ``FRAMEWIRE_INTEGRATIONS`` names ``sglang``. It
registers AROUND hooks with SGLang's hook registry:

- ``_try_save_cuda_video_direct``: every tensor save (CPU or CUDA), before the
  engine would materialize a CPU tensor's frames: True once the worker wrote it;
- ``_try_save_cuda_videos_direct``: several outputs of one request, encoded in
  parallel under the worker's admission;
- ``_save_video_ffmpeg`` (0.5.22 on): frames the engine materialized (upscaling,
  frame interpolation, frames handed back), without audio;
- ``CudaVideoEncoder.open`` (0.5.22 on): encode while decoding, CUDA frames;
- MiniMax-H3's ``minimax_h3_decode_reference_video_frames``: one decode per host.

Each target is probed first (present, with the parameters verified at the SGLang
version installed); what does not probe, and any version outside the range, is left
to SGLang with one WARNING. Whatever framewire does not reproduce (another container,
uint8 or float64 tensors, a quality outside 1..10, an unknown preset, a path outside
the worker's roots) and any save the worker cannot take run SGLang's original
function (docs/engines.md).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from framewire.integrations import _sglang_hooks as hooks
from framewire.integrations._probe import Engine, Probe, Target
from framewire.integrations._route import guarded
from framewire.integrations._switch import enabled, say_once

PLUGINS = "sglang.multimodal_gen.runtime.platforms.plugins"
CHECK_S = 600.0  # how long the check waits for SGLang to apply the hooks

SGLANG = Engine("SGLang", "sglang", ("0.5.21", "0.5.22", "0.5.23"))
EVERY, NEWER = SGLANG.versions, SGLANG.versions[1:]


def _at(versions: tuple[str, ...], shape: str) -> dict[str, str]:
    return dict.fromkeys(versions, shape)


def _utils(name: str, shape: str, versions: tuple[str, ...] = EVERY) -> Target:
    return Target(hooks.UTILS, name, _at(versions, shape))


# What the save hooks call of SGLang's utils.
HELPERS = (
    _utils("_resolve_ffmpeg_exe", "()"),
    _utils("_split_sample_audio", "(sample)"),
    _utils("_x264_auto_thread_count", "(height)"),
    _utils("_normalize_audio_to_numpy", "(audio)"),
    _utils("_pick_audio_sample_rate", "(*, audio_np, audio_sample_rate, fps, num_frames)"),
)
_SAVE = "audio_sample_rate, output_compression"
DIRECT = Target(
    hooks.UTILS,
    "_try_save_cuda_video_direct",
    {
        **_at(EVERY[:1], f"(*, save_file_path, sample, fps, {_SAVE})"),
        **_at(NEWER, f"(*, save_file_path, sample, fps, {_SAVE}, x264_preset=None)"),
    },
)
PARALLEL = Target(
    hooks.UTILS,
    "_try_save_cuda_videos_direct",
    {
        **_at(EVERY[:1], f"(samples, save_file_paths, *, fps, {_SAVE})"),
        **_at(NEWER, f"(samples, save_file_paths, *, fps, {_SAVE}, x264_preset=None)"),
    },
)
FRAMES = _utils(
    "_save_video_ffmpeg",
    "(save_file_path, frames, *, fps, quality, x264_preset=None, audio_path=None)",
    NEWER,
)
OPEN = _utils(
    "CudaVideoEncoder.open",
    "(cls, save_file_path, *, device, height, width, fps, "
    "num_frames, element_size=4, audio=None, audio_sample_rate=None, "
    "output_compression=None, x264_preset=None, max_queued_frames=0)",
    NEWER,
)
H3 = Target(
    hooks.H3_REFERENCE,
    "minimax_h3_decode_reference_video_frames",
    _at(
        EVERY,
        "(video_path, *, target_width, target_height, target_frame_count, "
        "fps=MINIMAX_H3_SUPPORTED_FPS, start_time_seconds=0.0, share_across_replicas=False)",
    ),
)
REPLICAS = Target(hooks.PARALLEL_STATE, "get_replica_group", _at(EVERY, "()"))

# Each hook: the target it goes on, its function, and what else of SGLang's it calls.
HOOKS: tuple[tuple[Target, Callable[..., Any], tuple[Target, ...]], ...] = (
    (DIRECT, hooks.save_direct, HELPERS),
    (PARALLEL, hooks.save_parallel, HELPERS),
    (FRAMES, hooks.save_frames, HELPERS),
    (OPEN, hooks.open_streamed, HELPERS),
    (H3, hooks.decode_reference_frames, (REPLICAS,)),
)
_registered: list[Target] = []  # the targets hooked in this process


def register() -> None:
    """The plugin's entry point: SGLang's ``load_plugins()`` calls it in every process.
    Registers nothing unless ``FRAMEWIRE_INTEGRATIONS`` names ``sglang``; never raises."""
    if enabled("sglang"):
        guarded("the SGLang integration's registration", _register)


def _register() -> None:
    probe = Probe(SGLANG)
    plugins = importlib.import_module(PLUGINS)
    for target, hook, calls in HOOKS:
        if target in _registered or not probe.wanted(target):
            continue
        if probe.allows((target, *calls)):
            plugins.HookRegistry.register(target.dotted, hook, plugins.HookType.AROUND)
            _registered.append(target)
    if _registered:
        threading.Thread(target=_check_later, name="framewire-sglang-check", daemon=True).start()


def hooked() -> dict[str, bool]:
    """Whether each function framewire hooked in this process is bound to its hook now
    (SGLang applies the hooks after the plugins ran)."""
    functions = {target: hook for target, hook, _ in HOOKS}
    found = {}
    for target in _registered:
        loaded = sys.modules.get(target.module)
        bound = _attr(loaded, target.name) if loaded is not None else None
        found[target.name] = _wraps(bound, functions[target])
    return found


def _attr(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return getattr(obj, "__func__", obj)  # a classmethod: its function


def _wraps(fn: Any, hook: Callable[..., Any]) -> bool:
    for _ in range(16):  # the registry's wrappers close over their hook
        if fn is None:
            return False
        if any(getattr(c, "cell_contents", None) is hook for c in fn.__closure__ or ()):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def check() -> dict[str, bool]:
    """Log which saves are routed (once), or which hooks did not take (SGLang only logs a
    hook that fails to apply)."""
    found = hooked()
    routed = [n for n, ok in found.items() if ok]
    missing = [n for n, ok in found.items() if not ok]
    url = os.environ.get("FRAMEWIRE_URL") or "the default address"
    if routed:
        say_once(
            "sglang:routes",
            "framewire: SGLang's %s save through the worker at %s; "
            "every other save runs SGLang's own code",
            ", ".join(routed),
            url,
        )
    if missing:
        say_once(
            "sglang:missing",
            "framewire: the hooks on SGLang's %s did not take: those saves run SGLang's own code",
            ", ".join(missing),
            level=logging.ERROR,
        )
    return found


def _check_later() -> None:
    """Wait (bounded) for SGLang to apply its plugins' hooks in this process, then check."""

    def wait_and_check() -> None:
        deadline = time.monotonic() + CHECK_S
        while time.monotonic() < deadline:
            plugins = sys.modules.get(PLUGINS)
            state = getattr(getattr(plugins, "_hook_application", None), "state", None)
            if getattr(state, "name", None) in ("COMPLETE", "FAILED"):
                check()
                return
            time.sleep(0.2)

    guarded("the check of the SGLang integration's hooks", wait_and_check)
