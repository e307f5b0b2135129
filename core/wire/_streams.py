"""Streaming encode sessions: one output whose frames arrive over time, chunk by chunk."""

from __future__ import annotations

from typing import Literal

from framewire.core.wire._messages import EncodeOptions, ErrorInfo
from framewire.core.wire._sources import (
    MAX_FRAMES,
    MAX_SIDE,
    DType,
    Flag,
    Int,
    Layout,
    Source,
    WireModel,
)
from pydantic import BaseModel, Field

StreamStateName = Literal["open", "streaming", "finishing", "done", "aborted", "failed"]


class StreamOpen(EncodeOptions):
    """``POST /v1/streams``: the output, and the geometry every chunk must have."""

    dtype: DType
    layout: Layout = Layout.CTHW
    height: Int = Field(ge=1, le=MAX_SIDE)
    width: Int = Field(ge=1, le=MAX_SIDE)
    frames: Int | None = Field(default=None, ge=1, le=MAX_FRAMES)  # the expected total
    validate_: Flag = Field(default=True, alias="validate")
    # A live view: viewers watch the encode as it goes (the answer's ``watch_url``).
    live: Flag = False
    # Each chunk answered once converted into the worker's staging, up to the worker's
    # FRAMEWIRE_STREAM_AHEAD_MIB ahead of its encoder (the producer makes the next one
    # meanwhile); false: once the encoder's pipe took it, for a producer whose frames
    # all exist already (a whole clip sent chunk by chunk gains nothing from more held).
    ahead: Flag = True

    model_config = EncodeOptions.model_config | {"populate_by_name": True}


class StreamOpened(BaseModel):
    """``201`` to ``POST /v1/streams``."""

    id: str
    idle_timeout_s: float
    # The worker process holding the session (``/v1/info``'s ``instance``): an answer
    # from another one means the session is gone with the worker that held it.
    instance: str | None = None
    # The watch page, with a short-lived signature in its query (when ``live`` was asked),
    # and the view as an HLS playlist, signed alike.
    watch_url: str | None = None
    hls_url: str | None = None
    # A memory:// output's ticket, known from the start: ``take`` with ``wait_s`` answers
    # once the file is whole, while the worker still hashes and checks it (the finish's
    # answer then names the same ticket, with its sha256).
    handoff: str | None = None


class StreamChunk(WireModel):
    """``POST /v1/streams/{id}/frames``: frames ``[first_frame, first_frame + n)``."""

    first_frame: Int = Field(ge=0, le=MAX_FRAMES)
    source: Source
    # Frames of a CUDA tensor the client could not share over IPC (one it received over
    # IPC itself, or memory torch's allocator did not make), copied to the host: counted.
    copied_from_gpu: Flag = False


class StreamChunkAck(BaseModel):
    """The chunk has been read: its buffer may be reused."""

    frames_received: int


class StreamState(BaseModel):
    """``GET /v1/streams/{id}``."""

    id: str
    path: str
    state: StreamStateName
    frames_received: int
    frames: int | None = None
    idle_timeout_s: float
    idle_s: float  # since the last chunk (or the open)
    error: ErrorInfo | None = None
    # A live session's watch page and HLS playlist, freshly signed (a viewer's URL
    # expires; the session may not).
    watch_url: str | None = None
    hls_url: str | None = None
