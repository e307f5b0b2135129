"""What an encode is asked for, and what of it can be refused before anything runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from framewire.core.errors import BadRequest
from framewire.core.media.argv import DEFAULT_PRESETS, PROFILES
from framewire.core.media.inputs import InputFile
from framewire.core.media.priority import FULL, Priority
from framewire.core.wire import MAX_FPS, MIN_FPS, DType, profile_misfit
from framewire.service._convert.convert import TORCH_DTYPES
from framewire.service._probe import require_pyav
from framewire.service._sources.audio import MemoryAudio


class AskedFor(Protocol):
    """What a request (the wire's options) or a local save asks of an encode."""

    @property
    def fps(self) -> float: ...
    @property
    def quality(self) -> float | None: ...
    @property
    def preset(self) -> str | None: ...
    @property
    def threads(self) -> int | None: ...
    @property
    def profile(self) -> str: ...
    @property
    def value_range(self) -> tuple[float, float] | None: ...


@dataclass(frozen=True)
class EncodeParams:
    fps: float
    quality: float | None = None  # None: the profile's default (imageio's 5)
    preset: str | None = None  # None: the profile's default (imageio's "fast")
    threads: int | None = None  # None or 0: x264's automatic count, passed explicitly
    # A file to mux: a path (opened here, a regular file only) or an open input (the
    # worker's, judged under its input roots, or samples from memory), the caller's.
    audio: Path | InputFile | None = None
    profile: str = "imageio"  # the engine save path reproduced (docs/engines.md)
    value_range: tuple[float, float] | None = None  # the vllm-omni profile's
    priority: Priority = FULL  # how its encoder child yields the CPU (bulk encodes do)
    # The ffmpeg executable the request's encoder identity named (None: the encoder's
    # default; the vllm-omni profile runs PyAV).
    ffmpeg: str | None = None

    @classmethod
    def asked(
        cls,
        options: AskedFor,
        audio: Path | InputFile | None = None,
        priority: Priority = FULL,
        ffmpeg: str | None = None,
    ) -> EncodeParams:
        """The parameters ``options`` ask for, with the audio opened and the encoder picked."""
        return cls(
            fps=options.fps,
            quality=options.quality,
            preset=options.preset,
            threads=options.threads,
            audio=audio,
            profile=options.profile,
            value_range=options.value_range,
            priority=priority,
            ffmpeg=ffmpeg,
        )

    @property
    def resolved_preset(self) -> str | None:
        return self.preset if self.preset is not None else DEFAULT_PRESETS[self.profile]


def check_params(params: EncodeParams) -> None:
    if not (MIN_FPS <= params.fps <= MAX_FPS):  # NaN fails both
        raise BadRequest(
            f"fps must be within {MIN_FPS:g}..{MAX_FPS:g}, got {params.fps}", code="bad_fps"
        )
    if params.quality is not None and not 0 <= params.quality <= 10:  # NaN fails too
        raise BadRequest(f"quality must be within 0..10, got {params.quality}", code="bad_quality")
    if params.profile not in PROFILES:
        raise BadRequest(f"unknown profile {params.profile!r}", code="bad_profile")
    if params.value_range is not None:
        low, high = params.value_range
        if params.profile != "vllm-omni" or not low < high:  # NaN fails too
            raise BadRequest(
                f"value_range {list(params.value_range)} needs the vllm-omni profile and "
                "low < high",
                code="bad_value_range",
            )
    if params.profile == "vllm-omni":
        require_pyav()  # its encoder is a PyAV child: 503 pyav_missing, before anything runs
    if params.threads is not None and params.threads < 0:
        raise BadRequest(f"threads must be >= 0, got {params.threads}", code="bad_threads")
    # What the wire model refuses for HTTP callers, for the API and the local CLI too:
    # otherwise the audio would be muxed where the engine writes none, or dropped.
    if params.audio is not None and params.profile == "diffusers":
        raise BadRequest("diffusers' export_to_video writes no audio", code="audio_unsupported")
    memory = isinstance(params.audio, MemoryAudio)
    rate = params.audio.source.sample_rate if isinstance(params.audio, MemoryAudio) else None
    misfit = profile_misfit(params.profile, params.fps, rate)
    if misfit is not None:
        raise BadRequest(misfit[1], code=misfit[0])
    if params.profile == "vllm-omni" and params.audio is not None and not memory:
        raise BadRequest(
            "the vllm-omni profile muxes audio samples in memory, not files",
            code="audio_unsupported",
        )


def check_geometry(params: EncodeParams, width: int, height: int, dtype: DType) -> None:
    """What a profile's encoder cannot take, refused before anything is made."""
    if params.value_range is not None and dtype is not DType.uint8:
        # The clamp's bounds are numbers of the frames' dtype (as in the engine, where
        # torch refuses them the same way): past its range they cannot be.
        info = torch.finfo(TORCH_DTYPES[dtype])
        low, high = params.value_range
        if not (info.min <= low and high <= info.max):
            raise BadRequest(
                f"value_range {list(params.value_range)} is outside what {dtype} holds "
                f"({info.min:g}..{info.max:g})",
                code="bad_value_range",
            )
    if params.profile == "vllm-omni" and (width % 2 or height % 2):
        # PyAV hands libx264 the exact size, and 4:2:0 needs even sides (the engine
        # fails the same way); the ffmpeg profiles scale up to multiples of 16.
        raise BadRequest(
            f"the vllm-omni profile encodes {width}x{height} as it is, and H.264 4:2:0 "
            "needs even sides",
            code="odd_size",
        )
