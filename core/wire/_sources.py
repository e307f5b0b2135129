"""What frames are and where they lie: dtypes, layouts, and the three source descriptors."""

from __future__ import annotations

import base64
import binascii
import math
import uuid
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator
from pydantic_core import PydanticCustomError

# Beyond these a request is absurd rather than big: 16K frames, 8K video.
MAX_FRAMES = 1 << 20
MAX_SIDE = 16384
# Below this ffmpeg's rate rational (limit_denominator) and the MP4 timescale give out.
MIN_FPS = 0.001
MAX_FPS = 1000

# Numbers on the wire are JSON numbers: "4", 4.0 for a count, or true, are refused
# rather than coerced.
Int = Annotated[int, Strict()]
Number = Annotated[float, Strict()]  # an int is a number too
Flag = Annotated[bool, Strict()]
# Names of shared memory that frames and audio alike are read from.
ShmKey = Annotated[str, Field(min_length=2, max_length=255, pattern=r"^/[A-Za-z0-9_.\-]+$")]
RegionName = Annotated[str, Field(min_length=1, max_length=255)]


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


class WireModel(BaseModel):
    """Every request body: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


def _kind_required(schema: dict[str, Any]) -> None:
    # ``kind`` has a default for Python callers, but on the wire it is the union's tag.
    required = schema.setdefault("required", [])
    if "kind" not in required:
        required.insert(0, "kind")


# Where a source's bytes are, for frames and audio alike. First among a source's bases, so
# that these fields come after the others, as the wire has them.
class InShm(WireModel):
    """Bytes in a POSIX shared-memory segment, named by its key."""

    kind: Literal["shm"] = "shm"
    key: ShmKey


class InRegion(WireModel):
    """Bytes in a region of the shared-memory registry, by its name."""

    kind: Literal["region"] = "region"
    region: RegionName


class _TensorFields(WireModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_kind_required)

    dtype: DType
    shape: list[Int] = Field(min_length=4, max_length=4)
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
    offset: Int = Field(default=0, ge=0)
    byte_size: Int = Field(gt=0)

    @model_validator(mode="after")
    def _check_size(self) -> _HostBytes:
        if self.byte_size != self.nbytes:
            raise PydanticCustomError(
                "byte_size_mismatch",
                f"byte_size {self.byte_size} does not match shape {self.shape} "
                f"of {self.dtype} ({self.nbytes} bytes)",
            )
        return self


class ShmSource(InShm, _HostBytes):
    """A POSIX shared-memory segment, opened read-only by the worker."""


class RegionSource(InRegion, _HostBytes):
    """Bytes inside a region registered with /v2/systemsharedmemory."""


IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t and cudaIpcEventHandle_t
MAX_HANDLE_BYTES = 1 << 16  # torch's handles are a few bytes longer than CUDA's own


def normalize_uuid(value: object) -> str:
    """A GPU UUID in one spelling (lowercase, dashed, no prefix), whichever way it came.

    Accepts torch's ``get_device_properties(d).uuid`` (or its 16 ``bytes``),
    nvidia-smi's ``GPU-...`` and a plain UUID string.
    """
    raw = getattr(value, "bytes", value)
    if isinstance(raw, (bytes, bytearray, list)) and len(raw) == 16:
        return str(uuid.UUID(bytes=bytes(raw)))
    text = str(value).strip()
    if text[:4].upper() in ("GPU-", "MIG-"):
        text = text[4:]
    return str(uuid.UUID(text))


def b64decode(text: str, what: str, *, max_bytes: int = MAX_HANDLE_BYTES) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise PydanticCustomError("bad_cuda_handle", f"{what} is not base64") from None
    if not 0 < len(raw) <= max_bytes:
        raise PydanticCustomError(
            "bad_cuda_handle", f"{what} holds {len(raw)} bytes, expected 1..{max_bytes}"
        )
    return raw


def contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return strides[::-1]


class CudaIpcSource(_TensorFields):
    """A CUDA tensor of another process: ``UntypedStorage._share_cuda_()`` spelled out.

    ``handle`` maps the producer's allocation, the storage lies ``storage_offset_bytes``
    into it and the tensor ``tensor_offset`` elements into the storage, with ``stride``
    (C-contiguous when absent). The GPU is named by UUID: indices differ between
    processes with different CUDA_VISIBLE_DEVICES.

    The worker reads the tensor only until it answers, and never touches the
    producer's IPC reference counter (``ref_counter_*``, carried for completeness):
    the producer keeps the tensor alive and unmodified until the answer, then
    releases that counter itself.
    """

    kind: Literal["cuda_ipc"] = "cuda_ipc"
    device_uuid: str = Field(min_length=1, max_length=64)
    device: Int = Field(default=0, ge=0)  # the producer's index, for messages only
    handle: str = Field(min_length=1)  # base64
    storage_size_bytes: Int = Field(gt=0)
    storage_offset_bytes: Int = Field(default=0, ge=0)
    ref_counter_handle: str | None = None  # base64
    ref_counter_offset: Int = Field(default=0, ge=0)
    event_handle: str | None = None  # base64; waited for when event_sync_required
    event_sync_required: Flag = False
    tensor_offset: Int = Field(default=0, ge=0)  # in elements, as Tensor.storage_offset()
    stride: list[Annotated[int, Strict(), Field(ge=0)]] | None = Field(
        default=None, min_length=4, max_length=4
    )
    # The producer's name for this share: when its call ends without the worker's
    # answer, it has the worker let go of it before releasing the memory (docs/api.md).
    share_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$")
    # The producer's torch.__version__: its handle's format is that torch's.
    torch_version: str | None = Field(default=None, max_length=64)

    @field_validator("device_uuid")
    @classmethod
    def _uuid(cls, v: str) -> str:
        try:
            return normalize_uuid(v)
        except ValueError:
            raise PydanticCustomError("bad_device_uuid", f"{v!r} is not a GPU UUID") from None

    @field_validator("handle")
    @classmethod
    def _handle(cls, v: str) -> str:
        b64decode(v, "handle")
        return v

    @field_validator("ref_counter_handle")
    @classmethod
    def _ref_counter(cls, v: str | None) -> str | None:
        if v is not None:
            b64decode(v, "ref_counter_handle", max_bytes=4096)
        return v

    @model_validator(mode="after")
    def _check_extent(self) -> CudaIpcSource:
        if self.event_sync_required:
            if self.event_handle is None:
                raise PydanticCustomError(
                    "bad_cuda_handle", "event_sync_required needs an event_handle"
                )
            event = b64decode(self.event_handle, "event_handle")
            if len(event) != IPC_HANDLE_BYTES:
                raise PydanticCustomError(
                    "bad_cuda_handle",
                    f"event_handle holds {len(event)} bytes, not {IPC_HANDLE_BYTES}",
                )
        last = self.tensor_offset + sum(
            (n - 1) * s for n, s in zip(self.shape, self.strides, strict=True)
        )
        need = (last + 1) * self.dtype.itemsize
        if need > self.storage_size_bytes:
            raise PydanticCustomError(
                "cuda_tensor_out_of_bounds",
                f"shape {self.shape}, stride {self.strides} and offset {self.tensor_offset} "
                f"of {self.dtype} reach byte {need}, past the storage's "
                f"{self.storage_size_bytes} bytes",
            )
        return self

    @property
    def strides(self) -> list[int]:
        return self.stride if self.stride is not None else contiguous_strides(self.shape)

    @property
    def handle_bytes(self) -> bytes:
        return base64.b64decode(self.handle)

    @property
    def event_bytes(self) -> bytes | None:
        if not self.event_sync_required or self.event_handle is None:
            return None
        return base64.b64decode(self.event_handle)


Source = Annotated[ShmSource | RegionSource | CudaIpcSource, Field(discriminator="kind")]
