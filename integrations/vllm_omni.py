"""vLLM-omni (0.30.0) encodes its videos through the worker.

Loaded by vLLM-omni's ``load_omni_general_plugins`` (entry point ``framewire`` of
``vllm_omni.general_plugins``) in every diffusion rank, the stage process and the
API server; it acts only when ``FRAMEWIRE_INTEGRATIONS`` names ``vllm-omni``.
**Trap:** ``VLLM_PLUGINS``, when set, is an allow-list for vLLM's
``vllm.general_plugins`` and vLLM-omni's group alike: it must name ``framewire``
(and what vLLM-omni registers for its own models).

Routed, each to a ``memory://`` output (vLLM-omni's contract is bytes) with the
``vllm-omni`` profile and PyAV's identity:

- ``diffusion/utils/chunked_video``'s ``ChunkedMP4Encoder`` (looked up by
  ``ChunkedVideoMP4Session`` when it opens its encoders): each batch entry a stream
  session. A chunk is copied out when ``push`` returns, so ``on_consumed`` fires
  then (exactly once, also when the push fails).
- ``_encode_video_bytes`` (bound by name in ``video_api_utils`` and
  ``serving_video``): vLLM-omni's own frame preparation, then a stream session 8
  frames at a time. Its direct path hands PyAV planar ``gbrp`` frames, its legacy
  path ``rgb24``; both quantize as ``clip(0, 1) * 255`` rounded half to even, and
  libswscale gives the same YUV from both (the tests compare the bytes).

Left to vLLM-omni: another codec or crf, codec options other than ``preset`` and
``threads``, odd sizes, audio rates AAC does not open at, frames other than uint8 or
float32 RGB, and a worker that is down or holds another PyAV (checked before any
frame is handed over). A worker that goes away after the first chunk of a
``ChunkedMP4Encoder`` fails that save: its chunks were released to the producer.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from framewire.client import FramewireError, VideoWriter, pyav_identity
from framewire.integrations._route import (
    WORKER,
    Declined,
    count,
    enabled,
    route,
    say_once,
    write_frames,
)

MEDIA = "vllm_omni.diffusion.utils.media_utils"
CHUNKED = "vllm_omni.diffusion.utils.chunked_video"
API = "vllm_omni.entrypoints.openai.video_api_utils"
SERVING = "vllm_omni.entrypoints.openai.serving_video"
# vLLM-omni passes no preset unless told: x264's own default, not the profile's ultrafast.
X264_DEFAULT = "medium"
AAC_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)
log = logging.getLogger("framewire.integrations")
_original: Any = None


def _declined(
    width: int,
    height: int,
    audio: Any,
    rate: int | None,
    video_codec: str,
    audio_codec: str,
    crf: str,
    options: dict[str, str] | None,
) -> str | None:
    """Why framewire would not give vLLM-omni's bytes for this encoder, or None."""
    if (video_codec, audio_codec, str(crf)) != ("h264", "aac", "18"):
        return "another codec or crf"
    if set(options or {}) - {"preset", "threads"}:
        return "codec options other than preset and threads"
    if width % 2 or height % 2:
        return "an odd size"
    if audio is not None and (44100 if rate is None else rate) not in AAC_RATES:
        return "an audio rate AAC does not open at"
    return None


def _samples(audio: np.ndarray) -> np.ndarray:
    """vLLM-omni's waveform (``(N,)``, ``(N, C)`` or ``(C, N)``) as framewire's
    ``[samples, channels]``: the channels are where vLLM-omni puts them."""
    samples = np.asarray(audio, dtype=np.float32)
    if samples.ndim == 2 and samples.shape[0] <= samples.shape[1]:
        samples = samples.T  # vLLM-omni takes the shorter side as the channels
    return np.ascontiguousarray(samples)


def _save_options(
    fps: float, codec_options: dict[str, str] | None, samples: Any, rate: int | None
) -> dict[str, Any]:
    """What vLLM-omni's PyAV encode would do, as framewire's save options."""
    options = codec_options or {}
    return {
        "fps": fps,
        "profile": "vllm-omni",
        "preset": options.get("preset", X264_DEFAULT),
        "threads": int(options["threads"]) if "threads" in options else None,
        "audio": None if samples is None else _samples(samples),
        "audio_sample_rate": rate,
        "encoder": pyav_identity(importlib.import_module("av").__version__),
    }


class ChunkedMP4Encoder:
    """vLLM-omni's ``ChunkedMP4Encoder`` (same constructor, ``push``, ``finish``,
    ``abort``): a worker's stream session when framewire gives its bytes, else an
    instance of vLLM-omni's own class."""

    def __new__(cls, **kw: Any) -> Any:
        why = _declined(kw["width"], kw["height"], kw.get("audio_waveform"),
                        kw.get("audio_sample_rate"), kw.get("video_codec", "h264"),
                        kw.get("audio_codec", "aac"), kw.get("crf", "18"),
                        kw.get("video_codec_options"))  # fmt: skip
        if why is None:
            return super().__new__(cls)
        count(f"vllm-omni:engine:{why}")
        say_once(f"vllm-omni:{why}", "framewire: a vllm-omni save runs the engine's own code: %s",
                 why)  # fmt: skip
        return _original(**kw)

    def __init__(self, **kw: Any) -> None:
        self._kw = kw
        audio = kw.get("audio_waveform")
        rate = None if audio is None else kw.get("audio_sample_rate") or 44100
        self._save = _save_options(kw["fps"], kw.get("video_codec_options"), audio, rate)
        self._save["layout"] = "THWC"
        self._writer: VideoWriter | None = None
        self._engine: Any = None  # vLLM-omni's own, when the worker did not take the first chunk
        self.width, self.height = int(kw["width"]), int(kw["height"])

    def push(self, chunk: np.ndarray, *, on_consumed: Callable[[], None] | None = None) -> None:
        """Hand over a (T, H, W, 3) uint8 chunk; ``on_consumed`` fires once it is copied
        (exactly once, also when this raises)."""
        handed = False  # on_consumed given to vLLM-omni's own encoder, which calls it
        try:
            if self._writer is None and self._engine is None and self._opened_with(chunk):
                return
            if self._engine is not None:
                handed = True
                self._engine.push(chunk, on_consumed=on_consumed)
                return
            assert self._writer is not None
            self._writer.write(chunk)
        finally:
            if on_consumed is not None and not handed:
                on_consumed()

    def _opened_with(self, first: np.ndarray) -> bool:
        """Open the session with the first chunk (True); if the worker does not take it,
        vLLM-omni's own encoder takes over (False): no chunk went anywhere yet."""
        writer = WORKER.client().open_video("memory://video.mp4", **self._save)
        try:
            writer.write(first)
        except Exception as exc:  # no worker, another PyAV, or framewire's own failure
            writer.abort()
            if isinstance(exc, FramewireError):
                why = f"the worker answered {exc.code}"
            else:
                why = f"framewire failed ({type(exc).__name__})"
            count(f"vllm-omni:engine:{why}")
            say_once(f"vllm-omni:{why}", "framewire: a vllm-omni save runs the engine's own "
                     "code: %s (%s)", why, exc, level=logging.WARNING)  # fmt: skip
            self._engine = _original(**self._kw)
            return False
        self._writer = writer
        count("vllm-omni:routed")
        return True

    def finish(self) -> bytes:
        """The MP4's bytes, once every chunk is encoded."""
        if self._engine is not None:
            data: bytes = self._engine.finish()
            return data
        if self._writer is None:  # no chunk came: as vLLM-omni's, which muxes an empty video
            self._engine = _original(**self._kw)
            return self.finish()
        result = self._writer.close()
        assert result.data is not None
        return result.data

    close = finish

    def abort(self) -> None:
        """Drop the output: nothing of it remains."""
        if self._engine is not None:
            self._engine.abort()
        elif self._writer is not None:
            self._writer.abort()

    def __enter__(self) -> ChunkedMP4Encoder:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abort()


def encode_bytes(original: Callable[..., bytes]) -> Callable[..., bytes]:
    """vLLM-omni's ``_encode_video_bytes`` through the worker (an output to memory), with
    vLLM-omni's own frame preparation; ``original`` for what framewire does not model."""

    def _encode_video_bytes(video: Any, fps: int | float, audio: Any = None,
                            audio_sample_rate: int | None = None,
                            video_codec_options: dict[str, str] | None = None,
                            frame_converter: Any = None) -> bytes:  # fmt: skip
        args = (video, fps, audio, audio_sample_rate, video_codec_options, frame_converter)

        def routed() -> bytes:
            api = sys.modules[API]
            # vLLM-omni's own normalization: any input it takes, as (H, W, C) frames.
            frames, shape, dtype = api._prepare_video_frames(video)
            if len(shape) != 3 or shape[2] != 3 or dtype not in (np.uint8, np.float32):
                raise Declined("frames that are not uint8 or float32 RGB")
            if any(f.dtype != dtype for f in frames):
                raise Declined("frames of mixed dtypes")
            rate = (
                api._resolve_audio_sample_rate(audio, audio_sample_rate)
                if audio is not None
                else None
            )
            samples = None if audio is None else api._coerce_audio_to_numpy(audio)
            why = _declined(shape[1], shape[0], samples, rate, "h264", "aac", "18",
                            video_codec_options)  # fmt: skip
            if why is not None:
                raise Declined(why)
            result = write_frames(
                "memory://video.mp4", frames,
                value_range=None if dtype == np.uint8 else (0.0, 1.0),
                **_save_options(float(fps), video_codec_options, samples, rate),
            )  # fmt: skip
            assert result.data is not None
            return result.data

        return route("vllm-omni", routed, original, args, {})

    _encode_video_bytes.__wrapped__ = original  # type: ignore[attr-defined]
    return _encode_video_bytes


def register() -> None:
    """The plugin's entry point. Replaces ``ChunkedMP4Encoder`` where vLLM-omni looks it
    up, only when ``FRAMEWIRE_INTEGRATIONS`` names ``vllm-omni``."""
    global _original
    if not enabled("vllm-omni"):
        return
    media = importlib.import_module(MEDIA)
    chunked = importlib.import_module(CHUNKED)
    if _original is None:
        _original = media.ChunkedMP4Encoder
    for module in (media, chunked):
        setattr(module, "ChunkedMP4Encoder", ChunkedMP4Encoder)  # noqa: B010
    api = importlib.import_module(API)
    if not hasattr(api._encode_video_bytes, "__wrapped__"):
        wrapped = encode_bytes(api._encode_video_bytes)
        # Bound by name in both: serving_video took it with ``from ... import`` (if it was
        # imported already; imported later, it takes the wrapped one from here).
        for name in (API, SERVING):
            if name in sys.modules:
                setattr(sys.modules[name], "_encode_video_bytes", wrapped)  # noqa: B010
    check()


def hooked() -> dict[str, bool]:
    """Whether each name vLLM-omni looks up holds framewire's now."""
    found = {f"{name}.ChunkedMP4Encoder": getattr(sys.modules.get(name), "ChunkedMP4Encoder",
                                                  None) is ChunkedMP4Encoder
             for name in (MEDIA, CHUNKED)}  # fmt: skip
    bytes_fn = getattr(sys.modules.get(API), "_encode_video_bytes", None)
    found[f"{API}._encode_video_bytes"] = getattr(bytes_fn, "__name__", "") == (
        "_encode_video_bytes") and hasattr(bytes_fn, "__wrapped__")  # fmt: skip
    return found


def check() -> dict[str, bool]:
    """Log once what is routed (or that the replacement did not take)."""
    found = hooked()
    if enabled("vllm-omni"):
        url = os.environ.get("FRAMEWIRE_URL") or "the default address"
        if all(found.values()):
            say_once("vllm-omni:routes", "framewire: vLLM-omni's ChunkedMP4Encoder and "
                     "_encode_video_bytes encode through the worker at %s; every other save "
                     "runs vLLM-omni's own code", url)  # fmt: skip
        else:
            say_once("vllm-omni:missing", "framewire: not replaced in vLLM-omni: %s",
                     [n for n, ok in found.items() if not ok],
                     level=logging.ERROR)  # fmt: skip
    return found
