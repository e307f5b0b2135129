"""The wire models: the one definition of every request and response body.

The worker validates requests with these models and the client builds them,
so the two sides cannot drift. Nothing here imports torch or the service.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

# Beyond these a request is absurd rather than big: 16K frames, 8K video.
MAX_FRAMES = 1 << 20
MAX_SIDE = 16384


class DType(StrEnum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"
    uint8 = "uint8"

    @property
    def itemsize(self) -> int:
        return {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1}[self.value]


class Layout(StrEnum):
    CTHW = "CTHW"
    TCHW = "TCHW"
    THWC = "THWC"

    def dims(self, shape: tuple[int, ...]) -> tuple[int, int, int, int]:
        """(channels, frames, height, width) of a shape in this layout."""
        if len(shape) != 4:
            raise ValueError(f"shape {list(shape)} is not 4-D")
        a, b, c, d = shape
        if self is Layout.CTHW:
            return a, b, c, d
        if self is Layout.TCHW:
            return b, a, c, d
        return d, a, b, c

    def shape(self, frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        if self is Layout.CTHW:
            return (3, frames, height, width)
        if self is Layout.TCHW:
            return (frames, 3, height, width)
        return (frames, height, width, 3)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _TensorFields(_Strict):
    dtype: DType
    shape: list[int] = Field(min_length=4, max_length=4)
    layout: Layout = Layout.CTHW

    @model_validator(mode="after")
    def _check_shape(self) -> _TensorFields:
        channels, frames, height, width = self.layout.dims(tuple(self.shape))
        if channels != 3:
            raise PydanticCustomError(
                "bad_shape", f"shape {self.shape} has {channels} channels in layout {self.layout}"
            )
        if not (1 <= frames <= MAX_FRAMES):
            raise PydanticCustomError(
                "bad_shape", f"frame count {frames} is outside 1..{MAX_FRAMES}"
            )
        if not (1 <= height <= MAX_SIDE and 1 <= width <= MAX_SIDE):
            raise PydanticCustomError(
                "bad_shape", f"frame size {width}x{height} is outside 1..{MAX_SIDE}"
            )
        return self

    @property
    def frames(self) -> int:
        return self.layout.dims(tuple(self.shape))[1]

    @property
    def height(self) -> int:
        return self.layout.dims(tuple(self.shape))[2]

    @property
    def width(self) -> int:
        return self.layout.dims(tuple(self.shape))[3]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _HostBytes(_TensorFields):
    offset: int = Field(default=0, ge=0)
    byte_size: int = Field(gt=0)

    @model_validator(mode="after")
    def _check_size(self) -> _HostBytes:
        if self.byte_size != self.nbytes:
            raise PydanticCustomError(
                "byte_size_mismatch",
                f"byte_size {self.byte_size} does not match shape {self.shape} "
                f"of {self.dtype} ({self.nbytes} bytes)",
            )
        return self


class ShmSource(_HostBytes):
    """A POSIX shared-memory segment, opened read-only by the worker."""

    kind: Literal["shm"] = "shm"
    key: str = Field(min_length=2, max_length=255, pattern=r"^/[A-Za-z0-9_.\-]+$")


class RegionSource(_HostBytes):
    """Bytes inside a region registered with /v2/systemsharedmemory."""

    kind: Literal["region"] = "region"
    region: str = Field(min_length=1, max_length=255)


class CudaIpcSource(_TensorFields):
    """A CUDA tensor of another process: ``UntypedStorage._share_cuda_()`` spelled out."""

    kind: Literal["cuda_ipc"] = "cuda_ipc"
    device_uuid: str
    handle: str  # base64 of the cudaIpcMemHandle
    storage_size_bytes: int = Field(gt=0)
    storage_offset_bytes: int = Field(ge=0)
    ref_counter_handle: str
    ref_counter_offset: int = Field(ge=0)
    event_handle: str | None = None
    event_sync_required: bool = False
    tensor_offset: int = Field(default=0, ge=0)  # in elements, as torch counts it
    stride: list[int] | None = None


Source = Annotated[ShmSource | RegionSource | CudaIpcSource, Field(discriminator="kind")]


class OutputSpec(_Strict):
    source: Source
    path: str = Field(min_length=1, max_length=4096)
    fps: float = Field(gt=0, le=1000)
    quality: int = Field(default=5, ge=1, le=10)
    preset: Literal[
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
    ] = "fast"
    threads: int | None = Field(default=None, ge=1, le=128)
    audio: str | None = Field(default=None, min_length=1, max_length=4096)

    @field_validator("fps")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise PydanticCustomError("bad_fps", "fps must be finite")
        return v

    @field_validator("path", "audio")
    @classmethod
    def _no_nul(cls, v: str | None) -> str | None:
        if v is not None and "\x00" in v:
            raise PydanticCustomError("bad_path", "paths may not contain NUL")
        return v


class EncodeRequest(_Strict):
    outputs: list[OutputSpec] = Field(min_length=1, max_length=64)
    validate_: bool = Field(default=True, alias="validate")

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
    started_at: float = 0.0  # worker's time.time() when the encode began
    finished_at: float = 0.0


class ErrorInfo(BaseModel):
    code: str
    message: str
    detail: str | None = None  # ffmpeg's stderr tail


class OutputResult(BaseModel):
    path: str
    ok: bool
    bytes: int | None = None
    sha256: str | None = None
    frames: int | None = None
    width: int | None = None
    height: int | None = None
    fps: float | None = None
    duration: float | None = None
    audio: AudioInfo | None = None
    route: Literal["stream", "fallback"] | None = None
    timings: Timings = Field(default_factory=Timings)
    error: ErrorInfo | None = None


class EncodeResponse(BaseModel):
    outputs: list[OutputResult]


class ProbeRequest(_Strict):
    paths: list[str] = Field(min_length=1, max_length=256)


class ProbeResponse(BaseModel):
    results: list[MediaInfo]


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
    "preset": "bad_preset",
    "threads": "bad_threads",
}
OUR_CODES = {"bad_shape", "byte_size_mismatch", "bad_fps", "bad_path"}


def error_code(errors: list[Any]) -> str:
    """The stable error code of a pydantic validation failure (its first error)."""
    first = errors[0] if errors else {}
    if first.get("type") in OUR_CODES:
        return str(first["type"])
    if first.get("type") == "union_tag_invalid":
        return "bad_source_kind"
    for part in reversed(first.get("loc", ())):  # type: ignore[arg-type]
        if isinstance(part, str) and part in FIELD_CODES:
            return FIELD_CODES[part]
    return "bad_request"


# --- the fd socket (reference decodes) ------------------------------------------------------


class DecodeRequest(_Strict):
    """One reference decode: a video file and the decode parameters of DESIGN §4."""

    op: Literal["decode"] = "decode"
    path: str = Field(min_length=1, max_length=4096)
    fps: float = Field(gt=0, le=1000)
    width: int = Field(ge=1, le=MAX_SIDE, strict=True)
    height: int = Field(ge=1, le=MAX_SIDE, strict=True)
    start: float = Field(default=0.0, ge=0)
    max_frames: int | None = Field(default=None, ge=1, le=MAX_FRAMES, strict=True)

    @field_validator("fps", "start")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise PydanticCustomError("bad_number", "must be finite")
        return v

    @field_validator("path")
    @classmethod
    def _no_nul(cls, v: str) -> str:
        if "\x00" in v:
            raise PydanticCustomError("bad_path", "paths may not contain NUL")
        return v

    @property
    def frame_bytes(self) -> int:
        return self.width * self.height * 3


class DecodeReply(BaseModel):
    """The JSON header of an fd-socket reply; a successful decode carries one fd beside it."""

    ok: bool
    frames: int | None = None
    height: int | None = None
    width: int | None = None
    byte_size: int | None = None
    cached: bool | None = None
    decode_ms: float | None = None
    code: str | None = None
    message: str | None = None
    detail: str | None = None  # ffmpeg's stderr tail, for decode_failed
    pong: bool | None = None
