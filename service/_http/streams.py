"""Streaming encode sessions over HTTP: open, chunks, finish, abort, state."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from framewire.core.wire import (
    OutputResult,
    StreamChunk,
    StreamChunkAck,
    StreamOpen,
    StreamOpened,
    StreamState,
)
from framewire.service._http.deps import Caller, WorkerParts
from framewire.service._http.errors import error_body
from framewire.service._http.live import view_url
from framewire.service._store.handoff import MemoryTarget

router = APIRouter()


@router.post("/v1/streams", status_code=201, response_model=StreamOpened)
async def open_stream(
    body: StreamOpen, request: Request, parts: WorkerParts, caller: Caller
) -> StreamOpened:
    session = await parts.sessions.open(body, caller)
    ticket = session.url.ticket if isinstance(session.url, MemoryTarget) else None
    opened = StreamOpened(
        id=session.id,
        idle_timeout_s=parts.settings.stream_idle_s,
        instance=parts.instance,
        handoff=ticket,
    )
    if session.live is None:
        return opened
    return opened.model_copy(update=_view_urls(request, parts, session.id))


def _view_urls(request: Request, parts: WorkerParts, stream_id: str) -> dict[str, str]:
    """A live view's signed URLs: its watch page and its HLS playlist."""
    return {
        "watch_url": view_url(request, parts, stream_id),
        "hls_url": view_url(request, parts, stream_id, "live.m3u8"),
    }


@router.post("/v1/streams/{stream_id}/frames", response_model=StreamChunkAck)
async def stream_frames(
    stream_id: str, body: StreamChunk, request: Request, parts: WorkerParts, caller: Caller
) -> StreamChunkAck:
    parts.sessions.check_owner(stream_id, caller)
    received = await parts.sessions.chunk(stream_id, body, caller, request.is_disconnected)
    return StreamChunkAck(frames_received=received)


@router.post("/v1/streams/{stream_id}/finish", response_model=OutputResult)
async def finish_stream(stream_id: str, parts: WorkerParts, caller: Caller) -> JSONResponse:
    parts.sessions.check_owner(stream_id, caller)
    status, result = await parts.sessions.finish(stream_id)
    payload = result.model_dump(mode="json")
    if status != 200:
        # As an encode answers a failed output: the error on top, the result beside it.
        assert result.error is not None
        payload = {"outputs": [payload]} | error_body(result.error.code, result.error.message)
    return JSONResponse(payload, status)


@router.delete("/v1/streams/{stream_id}", status_code=204)
async def abort_stream(stream_id: str, parts: WorkerParts, caller: Caller) -> Response:
    parts.sessions.check_owner(stream_id, caller)
    await parts.sessions.abort(stream_id)
    return Response(status_code=204)


@router.get("/v1/streams/{stream_id}", response_model=StreamState)
async def stream_state(
    stream_id: str, request: Request, parts: WorkerParts, caller: Caller
) -> StreamState:
    parts.sessions.check_owner(stream_id, caller)
    state = parts.sessions.state(stream_id)
    if state.state in ("open", "streaming") and parts.sessions.get(stream_id).live is not None:
        state = state.model_copy(update=_view_urls(request, parts, stream_id))
    return state
