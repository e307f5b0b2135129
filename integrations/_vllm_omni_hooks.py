"""vLLM-omni's video encoders, through the worker: what
:mod:`framewire.integrations.vllm_omni` puts where vLLM-omni looks them up.

Each encode goes to a ``memory://`` output (vLLM-omni's contract is bytes) with the
``vllm-omni`` profile and PyAV's identity, and the bytes that come back are checked
against the worker's sha256. Left to vLLM-omni: another codec or crf, codec options
other than ``preset`` and ``threads``, odd sizes, audio rates AAC does not open at,
frames other than uint8 or float32 RGB, audio before 0.28 (0.26 muxes it without
its timestamps), and a worker that is down or holds another PyAV (checked before any
frame is handed over).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from framewire.client import VideoWriter, pyav_identity
from framewire.integrations._route import failed, left, route
from framewire.integrations._switch import Declined, count
from framewire.integrations._worker import WORKER, Into, checked, copied, write_frames

MEDIA = "vllm_omni.diffusion.utils.media_utils"
CHUNKED = "vllm_omni.diffusion.utils.chunked_video"
API = "vllm_omni.entrypoints.openai.video_api_utils"
SERVING = "vllm_omni.entrypoints.openai.serving_video"
MEMORY = "memory://video.mp4"
# vLLM-omni passes no preset unless told: x264's own default, not the profile's ultrafast.
X264_DEFAULT = "medium"
AAC_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)
MARK = "__framewire__"  # on the functions framewire put in vLLM-omni's place

_original: Any = None  # vLLM-omni's own ChunkedMP4Encoder

# Set while a session left to vLLM-omni whole (integrations/_vllm_omni_session.py) makes
# its encoders: vLLM-omni's own, and its fallback said once (by the session), not once
# more per encoder.
_ENGINE_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "framewire_vllm_omni_engine_only", default=False
)


@contextlib.contextmanager
def left_to_engine() -> Iterator[None]:
    """The encoders made inside are vLLM-omni's own."""
    token = _ENGINE_ONLY.set(True)
    try:
        yield
    finally:
        _ENGINE_ONLY.reset(token)


def declined(
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


def save_options(
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
    instance of vLLM-omni's own class.

    If the worker does not begin on the first chunk (read its first frame),
    vLLM-omni's own encoder takes over. After that the chunks have gone back to the
    producer: a worker that fails later fails this encode as vLLM-omni's own encoder
    fails one (a RuntimeError at ``push`` or ``finish``, its message cleaned)."""

    def __new__(cls, **kw: Any) -> Any:
        if _ENGINE_ONLY.get():
            return _original(**kw)
        why = declined(
            kw["width"],
            kw["height"],
            kw.get("audio_waveform"),
            kw.get("audio_sample_rate"),
            kw.get("video_codec", "h264"),
            kw.get("audio_codec", "aac"),
            kw.get("crf", "18"),
            kw.get("video_codec_options"),
        )
        if why is None:
            return super().__new__(cls)
        left("vllm-omni", Declined(why))
        return _original(**kw)

    def __init__(self, **kw: Any) -> None:
        self._kw = kw
        audio = kw.get("audio_waveform")
        rate = None if audio is None else kw.get("audio_sample_rate") or 44100
        self._save = save_options(kw["fps"], kw.get("video_codec_options"), audio, rate)
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
            try:
                self._writer.write(chunk)
            except Exception as exc:
                raise failed("vllm-omni", exc) from None
        finally:
            if on_consumed is not None and not handed:
                on_consumed()

    def _opened_with(self, first: np.ndarray) -> bool:
        """Open the session with the first chunk (True); if the worker does not take it,
        vLLM-omni's own encoder takes over (False): no chunk went anywhere yet."""
        writer: VideoWriter | None = None
        try:
            # At the encoder's pace, as vLLM-omni's own (two chunks pending): the chunks
            # then go to the encoder from the client's buffer, not copied by the worker.
            writer = WORKER.client().open_video(MEMORY, ahead=False, **self._save)
            writer.write(first)
            # Taken once the worker read its first frame (its encoder runs): from here on the
            # chunks are its. Not the whole chunk: at the encoder's pace that is x264's time.
            writer.flush(1)
        except Exception as exc:  # no worker, another PyAV, or framewire's own failure
            if writer is not None:
                writer.abort()
            left("vllm-omni", exc)
            self._engine = _original(**self._kw)
            return False
        self._writer = writer
        return True

    def finish(self) -> bytes:
        """The MP4's bytes, once every chunk is encoded."""
        if self._engine is not None:
            data: bytes = self._engine.finish()
            return data
        if self._writer is None:  # no chunk came: as vLLM-omni's, which muxes an empty video
            self._engine = _original(**self._kw)
            return self.finish()
        try:
            result = checked(MEMORY, self._writer.close())
        except Exception as exc:
            raise failed("vllm-omni", exc) from None
        assert result.data is not None
        count("vllm-omni:routed")
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


def _quantizer() -> Into:
    """Float32 frames in [0, 1] as vLLM-omni quantizes them (``clip(0, 1) * 255`` rounded half
    to even, in float32), here, a chunk at a time (a quarter of the bytes to hand over),
    in place in one float frame kept for the whole clip."""
    scratch: np.ndarray | None = None

    def into(frame: np.ndarray, out: np.ndarray) -> None:
        nonlocal scratch
        if scratch is None:
            scratch = np.empty(frame.shape, np.float32)
        np.clip(frame, 0.0, 1.0, out=scratch)
        scratch *= np.float32(255.0)
        np.rint(scratch, out=scratch)
        out[...] = scratch

    return into


def _frames(api: Any, video: Any) -> tuple[list[np.ndarray], tuple[int, ...], Any]:
    """vLLM-omni's own normalization of any input it takes, as (H, W, C) frames (what its
    ``_prepare_video_frames`` does, which 0.26 does not have), their shape and dtype."""
    frames = api._coerce_video_to_frames(video)
    if not frames or any(f.shape != frames[0].shape for f in frames):
        raise Declined("no frames, or frames of several shapes")  # vLLM-omni refuses them
    return frames, frames[0].shape, np.result_type(*(f.dtype for f in frames))


def encode_bytes(original: Callable[..., bytes], version: str | None) -> Callable[..., bytes]:
    """vLLM-omni's ``_encode_video_bytes`` (with the parameters of ``version``'s, which
    the probe verified) through the worker (an output to memory), with vLLM-omni's own
    frame preparation; ``original`` for what framewire does not model."""
    parameters = inspect.signature(original)

    @functools.wraps(original)
    def _encode_video_bytes(*args: Any, **kwargs: Any) -> bytes:
        try:
            call = parameters.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # vLLM-omni's own error
        call.apply_defaults()
        given = call.arguments

        def routed() -> bytes:
            api = sys.modules[API]
            video, audio, options = given["video"], given["audio"], given["video_codec_options"]
            frames, shape, dtype = _frames(api, video)
            if len(shape) != 3 or shape[2] != 3 or dtype not in (np.uint8, np.float32):
                raise Declined("frames that are not uint8 or float32 RGB")
            if any(f.dtype != dtype for f in frames):
                raise Declined("frames of mixed dtypes")
            if audio is not None and version == "0.26.0":
                raise Declined("audio, which vLLM-omni 0.26 muxes without timestamps")
            rate = None
            samples = None
            if audio is not None:
                rate = api._resolve_audio_sample_rate(audio, given["audio_sample_rate"])
                samples = api._coerce_audio_to_numpy(audio)
            why = declined(shape[1], shape[0], samples, rate, "h264", "aac", "18", options)
            if why is not None:
                raise Declined(why)
            into = copied if dtype == np.uint8 else _quantizer()
            save = save_options(float(given["fps"]), options, samples, rate)
            result = write_frames(MEMORY, frames, into, **save)
            assert result.data is not None
            return result.data

        return route("vllm-omni", routed, original, args, kwargs)

    setattr(_encode_video_bytes, MARK, True)
    return _encode_video_bytes


def replace_chunked(original: Any) -> type[ChunkedMP4Encoder]:
    """Framewire's ChunkedMP4Encoder, falling back on vLLM-omni's ``original``."""
    global _original
    if _original is None:
        _original = original
    return ChunkedMP4Encoder
