"""The HTTP request and response bodies: encodes, probes, region registration."""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence
from typing import Any, Literal

from framewire.core.errors import BadRequest
from framewire.core.media.argv import PROFILES, profile_rate, rate_arg
from framewire.core.media.identity import is_identity
from framewire.core.wire._audio import AAC_SAMPLE_RATES, Audio
from framewire.core.wire._sources import (
    MAX_FPS,
    MIN_FPS,
    Flag,
    Int,
    Number,
    Source,
    WireModel,
)
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

Preset = Literal[
    "ultrafast",
    "superfast",
    "veryfast",
    "faster",
    "fast",
    "medium",
    "slow",
    "slower",
    "veryslow",
    "placebo",
]


# The engine save path an output reproduces byte for byte (docs/engines.md).
Profile = Literal["imageio", "sglang", "diffusers", "vllm-omni"]


def profile_misfit(profile: str, fps: float, audio_rate: int | None) -> tuple[str, str] | None:
    """(code, message) when ``profile``'s encoder cannot take this rate or audio rate:
    the engine would fail too, so it is bad input, refused before anything runs."""
    if profile in PROFILES and profile_rate(profile, fps) <= 0:
        return "bad_fps", f"fps {fps:g} is written as {rate_arg(profile, fps)!r} by {profile}"
    if profile == "vllm-omni" and audio_rate is not None and audio_rate not in AAC_SAMPLE_RATES:
        rates = ", ".join(str(r) for r in AAC_SAMPLE_RATES)
        return "bad_sample_rate", (
            f"the vllm-omni profile encodes AAC at the audio's own rate: {rates}; got {audio_rate}"
        )
    return None


MAX_PRESIGN_S = 7 * 24 * 3600  # SigV4's own limit


class EncodeOptions(WireModel):
    """Where an output goes and how it is encoded: an encode's output, a stream session.

    ``quality`` and ``preset`` left out take the profile's defaults: quality 5
    (vLLM-omni: crf 18), preset ``fast`` (diffusers: none, x264's medium;
    vLLM-omni: ``ultrafast``).
    """

    path: str = Field(min_length=1, max_length=4096)
    fps: Number = Field(ge=MIN_FPS, le=MAX_FPS)
    quality: Number | None = Field(default=None, ge=0, le=10)
    preset: Preset | None = None
    # 0: x264's own count (what vLLM-omni passes); None: the profile's default.
    threads: Int | None = Field(default=None, ge=0, le=128)
    audio: Audio | None = None
    profile: Profile = "imageio"
    value_range: tuple[Number, Number] | None = None  # vllm-omni: (0, 1) or (-1, 1)
    # An s3:// path: also answer a presigned GET URL of the object, valid this long.
    presign_s: Int | None = Field(default=None, ge=1, le=MAX_PRESIGN_S)
    # The encoder whose bytes the output must have (core.media.identity: an ffmpeg
    # binary's sha256, or PyAV's version); None: the worker's default. 409
    # encoder_unavailable when the worker holds no such encoder.
    encoder: str | None = Field(default=None, min_length=1, max_length=160)

    @field_validator("fps", "quality")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise PydanticCustomError("not_finite", "must be finite")
        return v

    @field_validator("encoder")
    @classmethod
    def _identity(cls, v: str | None) -> str | None:
        if v is not None and not is_identity(v):
            raise PydanticCustomError(
                "bad_encoder", "encoder is an identity: ffmpeg-sha256:<hex> or pyav:<version>"
            )
        return v

    @field_validator("path", "audio")
    @classmethod
    def _no_nul(cls, v: object) -> object:
        if isinstance(v, str) and "\x00" in v:
            raise PydanticCustomError("bad_path", "paths may not contain NUL")
        return v

    @model_validator(mode="after")
    def _profile_fits(self) -> EncodeOptions:
        if self.value_range is not None:
            lo, hi = self.value_range
            if self.profile != "vllm-omni":
                raise PydanticCustomError(
                    "bad_value_range", "value_range is the vllm-omni profile's alone"
                )
            if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
                raise PydanticCustomError(
                    "bad_value_range", f"value_range {[lo, hi]} is not a finite low < high"
                )
        audio_rate = (
            None if self.audio is None or isinstance(self.audio, str) else (self.audio.sample_rate)
        )
        misfit = profile_misfit(self.profile, self.fps, audio_rate)
        if misfit is not None:
            raise PydanticCustomError(*misfit)
        if self.presign_s is not None and not self.path.startswith("s3://"):
            raise PydanticCustomError("presign_needs_url", "presign_s is for s3:// outputs")
        if self.audio is not None and self.profile == "diffusers":
            raise PydanticCustomError(
                "audio_unsupported", "diffusers' export_to_video writes no audio"
            )
        if self.profile == "vllm-omni" and self.audio is not None:
            if isinstance(self.audio, str):
                raise PydanticCustomError(
                    "audio_unsupported",
                    "the vllm-omni profile muxes audio samples in memory, not files",
                )
            if self.audio.dtype != "float32" or self.audio.channels > 2:
                raise PydanticCustomError(
                    "audio_unsupported",
                    "vLLM-omni muxes float32 mono or stereo audio only",
                )
        return self


class OutputSpec(EncodeOptions):
    """One output of ``POST /v1/videos:encode``: the options and where the frames are."""

    source: Source


class EncodeRequest(WireModel):
    outputs: list[OutputSpec] = Field(min_length=1, max_length=64)
    validate_: Flag = Field(default=True, alias="validate")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class AudioInfo(BaseModel):
    codec: str
    sample_rate: int
    channels: int
    duration: float | None = None


class MediaInfo(BaseModel):
    path: str
    frames: int
    width: int
    height: int
    fps: float
    fps_exact: str
    codec: str
    pix_fmt: str | None
    duration: float | None
    audio: AudioInfo | None = None


class Timings(BaseModel):
    queue_ms: float = 0.0
    encode_ms: float = 0.0
    validate_ms: float = 0.0
    upload_ms: float = 0.0  # an object URL output: the encoded file to the object stored
    started_at: float = 0.0  # worker's time.time() when the encode began
    finished_at: float = 0.0


class ErrorInfo(BaseModel):
    code: str
    message: str
    detail: str | None = None  # ffmpeg's stderr tail


class OutputResult(BaseModel):
    path: str
    ok: bool
    url: str | None = None  # an object URL output: the object, once stored
    presigned_url: str | None = None  # when presign_s asked for one
    # A memory:// output: the ticket its bytes are taken with (fd socket, "take"), and the
    # bytes, once the client took them (never on the wire).
    handoff: str | None = None
    data: builtins.bytes | None = Field(default=None, exclude=True, repr=False)  # not .bytes
    bytes: int | None = None
    sha256: str | None = None
    frames: int | None = None
    width: int | None = None
    height: int | None = None
    fps: float | None = None
    duration: float | None = None
    audio: AudioInfo | None = None
    route: Literal["stream", "fallback", "local"] | None = None  # local: no worker reached
    timings: Timings = Field(default_factory=Timings)
    error: ErrorInfo | None = None


class EncodeResponse(BaseModel):
    outputs: list[OutputResult]


class ProbeRequest(WireModel):
    paths: list[str] = Field(min_length=1, max_length=256)


class ProbeResponse(BaseModel):
    results: list[MediaInfo]


# --- the shared-memory region registry (Triton's extension) -----------------------------


class RegisterSystemRegion(BaseModel):
    """``POST /v2/systemsharedmemory/region/{name}/register``"""

    key: str
    offset: Int = Field(default=0, ge=0)
    byte_size: Int = Field(gt=0)


class RawHandle(BaseModel):
    b64: str


class RegisterCudaRegion(BaseModel):
    """``POST /v2/cudasharedmemory/region/{name}/register``"""

    raw_handle: RawHandle
    device_id: Int = Field(ge=0)  # the client's index: the same GPU only with the same
    byte_size: Int = Field(gt=0)  # CUDA_VISIBLE_DEVICES; device_uuid, when sent, wins
    device_uuid: str | None = Field(default=None, max_length=64)  # framewire's extension


# Pydantic field names whose errors get a code of their own.
FIELD_CODES = {
    "fps": "bad_fps",
    "layout": "bad_layout",
    "dtype": "bad_dtype",
    "shape": "bad_shape",
    "byte_size": "bad_byte_size",
    "offset": "bad_offset",
    "key": "bad_shm_key",
    "path": "bad_path",
    "kind": "bad_source_kind",
    "quality": "bad_quality",
    "profile": "bad_profile",
    "value_range": "bad_value_range",
    "sample_rate": "bad_sample_rate",
    "preset": "bad_preset",
    "threads": "bad_threads",
    "presign_s": "bad_presign_s",
    "stride": "bad_stride",
    "tensor_offset": "bad_offset",
    "storage_offset_bytes": "bad_offset",
    "storage_size_bytes": "bad_byte_size",
    "device_uuid": "bad_device_uuid",
    "handle": "bad_cuda_handle",
    "event_handle": "bad_cuda_handle",
    "ref_counter_handle": "bad_cuda_handle",
}
AUDIO_CODES = {"dtype": "bad_audio_dtype", "shape": "bad_audio_shape", "path": "bad_path"}
OUR_CODES = {
    "bad_shape",
    "byte_size_mismatch",
    "bad_fps",
    "bad_path",
    "bad_cuda_handle",
    "bad_device_uuid",
    "cuda_tensor_out_of_bounds",
    "bad_value_range",
    "bad_sample_rate",
    "bad_audio_channels",
    "bad_audio_shape",
    "audio_too_large",
    "audio_unsupported",
    "presign_needs_url",
    "bad_encoder",
}


def refusal(errors: ValidationError | Sequence[Any], *, code: str | None = None) -> BadRequest:
    """The 400 a validation failure (or its list of errors) is answered with: where, what,
    and its stable code (``code``: the one the route uses for every refusal)."""
    if isinstance(errors, ValidationError):
        errors = errors.errors()
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = f"{where}: {first.get('msg', 'invalid request')}" if where else "invalid request"
    return BadRequest(message, code=code or error_code(errors))


def error_code(errors: Sequence[Any]) -> str:
    """The stable error code of a pydantic validation failure (its first error)."""
    first = errors[0] if errors else {}
    if first.get("type") in OUR_CODES:
        return str(first["type"])
    if first.get("type") in ("union_tag_invalid", "union_tag_not_found"):
        return "bad_source_kind"
    loc = first.get("loc", ())
    for part in reversed(loc):
        if isinstance(part, str) and part in FIELD_CODES:
            if "audio" in loc and part in AUDIO_CODES:
                return AUDIO_CODES[part]
            return FIELD_CODES[part]
    return "bad_request"
