"""The fd socket's messages (docs/api.md): one JSON line each way, descriptors beside them.

A request names its ``op``: ``decode`` (a reference video, answered with a
sealed memfd), ``register`` / ``unregister`` (a rank's frames handed over as a
descriptor, a region of the shared-memory registry), ``ping``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from framewire.core.media.identity import FFMPEG as FFMPEG_IDENTITY
from framewire.core.wire._sources import (
    MAX_FPS,
    MAX_FRAMES,
    MAX_SIDE,
    MIN_FPS,
    Int,
    Number,
    WireModel,
)
from pydantic import BaseModel, Field, field_validator
from pydantic_core import PydanticCustomError

# A region's name, as the registry and the HTTP routes spell it.
REGION_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"


class DecodeRequest(WireModel):
    """One reference decode: a video file and the decode parameters (docs/byte-exactness.md)."""

    op: Literal["decode"] = "decode"
    path: str = Field(min_length=1, max_length=4096)
    fps: Number = Field(ge=MIN_FPS, le=MAX_FPS)
    width: Int = Field(ge=1, le=MAX_SIDE)
    height: Int = Field(ge=1, le=MAX_SIDE)
    start: Number = Field(default=0.0, ge=0)
    max_frames: Int | None = Field(default=None, ge=1, le=MAX_FRAMES)
    # The ffmpeg the frames must come from (core.media.identity); None: the worker's.
    decoder: str | None = Field(default=None, min_length=1, max_length=160)

    @field_validator("decoder")
    @classmethod
    def _identity(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(FFMPEG_IDENTITY):
            raise PydanticCustomError("bad_decoder", "decoder is ffmpeg-sha256:<hex>")
        return v

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

    def parameters(self) -> dict[str, Any]:
        """The decode's keywords (fps, width, height, start, max_frames, and the decoder
        when one is named), for the calls that take them one by one."""
        return self.model_dump(
            include={"fps", "width", "height", "start", "max_frames", "decoder"}, exclude_none=True
        )


class FdReply(BaseModel):
    """The JSON header of every fd-socket reply; a successful decode carries one fd beside it."""

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
    reason: str | None = None  # a failure's stable code, as HTTP names it (bad_fd, ...)
    name: str | None = None  # register: the region
    sealed: bool | None = None  # register: F_SEAL_SHRINK was set, so it is mapped, not read
    instance: str | None = None  # ping: this worker process (also in /v1/info)


class FdRegister(WireModel):
    """``register``: the one descriptor beside this line holds ``byte_size`` bytes of frames
    at ``offset``; they become region ``name`` until unregistered or the connection closes."""

    op: Literal["register"] = "register"
    name: str = Field(pattern=REGION_NAME)
    offset: Int = Field(default=0, ge=0)
    byte_size: Int = Field(ge=1)


class FdUnregister(WireModel):
    """``unregister``: drop a region this connection registered."""

    op: Literal["unregister"] = "unregister"
    name: str = Field(pattern=REGION_NAME)


MAX_TAKE_WAIT_S = 3600.0  # a take waits at most this long for its output to be held


class FdTake(WireModel):
    """``take``: the sealed memfd holding a ``memory://`` output, by the ticket its result
    named (``handoff``); answered with ``byte_size`` and the descriptor, once per ticket.
    ``wait_s``: for a ticket a stream session's opening named, how long to wait for its
    output to be held (answered once its file is whole)."""

    op: Literal["take"] = "take"
    ticket: str = Field(pattern=r"^[0-9a-f]{32}$")
    wait_s: float = Field(default=0.0, ge=0.0, le=MAX_TAKE_WAIT_S)
