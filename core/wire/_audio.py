"""Audio handed over in memory: samples in a segment or a region, like frames (DESIGN 3.2)."""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated, Any

from framewire.core.wire._sources import InRegion, InShm, Int, WireModel, _kind_required
from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 8000, 192000  # SGLang's bounds for a usable rate
MAX_CHANNELS = 8
# The rates FFmpeg's AAC encoder opens at (MPEG-4's table), within the bounds above: the
# vllm-omni profile's PyAV encodes audio at its own rate, and any other fails to open.
AAC_SAMPLE_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200,
                    96000)  # fmt: skip
# The worker holds one WAV per distinct audio (within its audio budget): 256 MiB is
# 11 minutes of 48 kHz stereo float32, far past a generated clip.
MAX_AUDIO_BYTES = 256 << 20


class AudioDType(StrEnum):
    float32 = "float32"  # clamped to [-1, 1] before it is written, as SGLang does
    int16 = "int16"

    @property
    def itemsize(self) -> int:
        return 4 if self is AudioDType.float32 else 2


class _AudioFields(WireModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_kind_required)

    dtype: AudioDType
    shape: list[Int] = Field(min_length=2, max_length=2)  # [samples, channels]
    sample_rate: Int
    offset: Int = Field(default=0, ge=0)
    byte_size: Int = Field(gt=0)

    @model_validator(mode="after")
    def _check(self) -> _AudioFields:
        samples, channels = self.shape
        if not MIN_SAMPLE_RATE <= self.sample_rate <= MAX_SAMPLE_RATE:
            raise PydanticCustomError(
                "bad_sample_rate",
                f"sample_rate {self.sample_rate} is outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE}",
            )
        if not 1 <= channels <= MAX_CHANNELS:
            raise PydanticCustomError(
                "bad_audio_channels", f"{channels} audio channels, expected 1..{MAX_CHANNELS}"
            )
        if samples < 1:
            raise PydanticCustomError("bad_audio_shape", f"{samples} audio samples")
        if self.byte_size != self.nbytes:
            raise PydanticCustomError(
                "byte_size_mismatch",
                f"audio byte_size {self.byte_size} does not match shape {self.shape} "
                f"of {self.dtype} ({self.nbytes} bytes)",
            )
        if self.nbytes > MAX_AUDIO_BYTES:
            raise PydanticCustomError(
                "audio_too_large", f"{self.nbytes} bytes of audio, over {MAX_AUDIO_BYTES}"
            )
        return self

    @property
    def samples(self) -> int:
        return self.shape[0]

    @property
    def channels(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class ShmAudio(InShm, _AudioFields):
    """Samples in a POSIX shared-memory segment."""


class RegionAudio(InRegion, _AudioFields):
    """Samples in a registered region (one registered over the fd socket too)."""


AudioSource = Annotated[ShmAudio | RegionAudio, Field(discriminator="kind")]


def _audio_tag(value: Any) -> str:
    return "path" if isinstance(value, str) else "memory"


# An output's ``audio``: a file under the input roots, or samples in memory. Tagged by
# type, so a refusal names what was wrong with the one that was meant.
Audio = Annotated[
    Annotated[str, Tag("path"), Field(min_length=1, max_length=4096)]
    | Annotated[AudioSource, Tag("memory")],
    Discriminator(_audio_tag),
]
