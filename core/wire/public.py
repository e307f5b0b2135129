"""The wire's names a user sees: the models a caller builds or reads, and their limits.

``framewire.client.wire`` is exactly this set; ``framewire.core.wire`` is this set
and the helpers both sides validate with.
"""

from framewire.core.wire._audio import (
    MAX_CHANNELS,
    MAX_SAMPLE_RATE,
    MIN_SAMPLE_RATE,
    AudioDType,
    AudioSource,
    RegionAudio,
    ShmAudio,
)
from framewire.core.wire._fdsocket import DecodeRequest, FdRegister, FdReply, FdUnregister
from framewire.core.wire._messages import (
    AudioInfo,
    EncodeOptions,
    EncodeRequest,
    EncodeResponse,
    ErrorInfo,
    MediaInfo,
    OutputResult,
    OutputSpec,
    Preset,
    ProbeRequest,
    ProbeResponse,
    Profile,
    RawHandle,
    RegisterCudaRegion,
    RegisterSystemRegion,
    Timings,
)
from framewire.core.wire._sources import (
    MAX_FPS,
    MAX_FRAMES,
    MAX_SIDE,
    MIN_FPS,
    CudaIpcSource,
    DType,
    Layout,
    RegionSource,
    ShmSource,
    Source,
)
from framewire.core.wire._streams import (
    StreamChunk,
    StreamChunkAck,
    StreamOpen,
    StreamOpened,
    StreamState,
)

# A tuple: framewire.core.wire extends it into a new one, this one stays as it is.
__all__: tuple[str, ...] = (
    "MAX_CHANNELS",
    "MAX_FPS",
    "MAX_FRAMES",
    "MAX_SAMPLE_RATE",
    "MAX_SIDE",
    "MIN_FPS",
    "MIN_SAMPLE_RATE",
    "AudioDType",
    "AudioInfo",
    "AudioSource",
    "CudaIpcSource",
    "DType",
    "DecodeRequest",
    "EncodeOptions",
    "EncodeRequest",
    "EncodeResponse",
    "ErrorInfo",
    "FdRegister",
    "FdReply",
    "FdUnregister",
    "Layout",
    "MediaInfo",
    "OutputResult",
    "OutputSpec",
    "Preset",
    "ProbeRequest",
    "ProbeResponse",
    "Profile",
    "RawHandle",
    "RegionAudio",
    "RegionSource",
    "RegisterCudaRegion",
    "RegisterSystemRegion",
    "ShmAudio",
    "ShmSource",
    "Source",
    "StreamChunk",
    "StreamChunkAck",
    "StreamOpen",
    "StreamOpened",
    "StreamState",
    "Timings",
)
