"""The live view as HLS over HTTP: ``GET /v1/streams/{id}/live.m3u8`` and the init
segment, segments and parts it names under ``live/`` (the playlist: _stream/hls.py).

Access is the live view's (the token and the session's owner, or a signed URL,
whose query every URI in the playlist carries); each request holds a viewer slot
while it is answered. Caching: a playlist is never kept (``no-store``); the init
segment, segments and parts never change once listed, so any cache may keep them
(``immutable``): a shared one when the request was signed, for no longer than the
signature lasts, the player's own when it came with the token. Responses carry
``Access-Control-Allow-Origin: *`` so that an hls.js page of any origin plays a
signed URL: the signature, not the origin, is what grants access.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from contextlib import ExitStack
from urllib.parse import urlencode

from fastapi import APIRouter, Request, Response
from framewire.core.errors import BadRequest, NotFound
from framewire.service._http.deps import Caller, WorkerParts
from framewire.service._http.live import view_feed
from framewire.service._stream.hls import (
    BLOCK_MAX_S,
    Media,
    check_reload,
    complete_segments,
    media_named,
    media_pieces,
    media_state,
    playlist,
    reload_ready,
)
from framewire.service._stream.live import LiveFeed
from starlette.types import Receive, Scope, Send

router = APIRouter()

PLAYLIST_TYPE = "application/vnd.apple.mpegurl"
CORS = {"access-control-allow-origin": "*", "x-content-type-options": "nosniff"}
MEDIA_MAX_AGE_S = 86_400
NUMBER = re.compile(r"[0-9]{1,10}")
MEDIA_SLICE = 64 << 10  # what one media response holds of its own while a reader is slow


class HeldResponse(Response):
    """A response that holds what its request took (a viewer slot) until it is sent."""

    def __init__(self, content: bytes | str, release: Callable[[], None], **kwargs: object):
        super().__init__(content, **kwargs)  # type: ignore[arg-type]
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


class MediaResponse(Response):
    """Media sent from the history's own bytes, which every request shares, a slice at a
    time: the server waits for the connection to take each before the next (its flow
    control), so a reader that never reads holds a slice, not a copy of the segment.
    Holds what its request took until it is sent, as :class:`HeldResponse` does."""

    def __init__(self, pieces: list[bytes], release: Callable[[], None], headers: dict[str, str]):
        self.pieces = pieces
        self._release = release
        self.status_code = 200
        self.media_type = "video/mp4"
        self.background = None
        size = sum(len(p) for p in pieces)
        self.init_headers(headers | {"content-length": str(size)})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            start = {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
            await send(start)
            for piece in self.pieces:
                view = memoryview(piece)
                for at in range(0, len(view), MEDIA_SLICE):
                    body = bytes(view[at : at + MEDIA_SLICE])
                    await send({"type": "http.response.body", "body": body, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._release()


def _number(request: Request, name: str) -> int | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    if not NUMBER.fullmatch(raw):
        raise BadRequest(f"{name}={raw!r} is not a number", code="bad_hls_request")
    return int(raw)


def _signed(request: Request, parts: WorkerParts, stream_id: str) -> tuple[str, int | None]:
    """The signed query the request came with, to carry into the playlist's URIs, and
    when it expires ('' and None: it came with the token)."""
    expires = parts.sessions.signer.expiry(stream_id, request.url.query)
    if expires is None:
        return "", None
    return urlencode({"exp": expires, "sig": request.query_params["sig"]}), expires


@router.get("/v1/streams/{stream_id}/live.m3u8", response_class=Response)
async def live_m3u8(
    stream_id: str, request: Request, parts: WorkerParts, caller: Caller
) -> Response:
    feed = view_feed(request, parts, caller, stream_id, ended=True)
    msn, part = _number(request, "_HLS_msn"), _number(request, "_HLS_part")
    with ExitStack() as held:
        held.enter_context(feed.hls_request())
        history, timing, metrics = feed.history, feed.timing, parts.metrics
        check_reload(history, timing, msn, part)
        metrics.hls_playlists.labels("no" if msn is None else "yes").inc()
        if msn is not None:
            result = await feed.wait_for(lambda: reload_ready(history, msn, part), BLOCK_MAX_S)
            metrics.hls_blocked.labels(result).inc()
        else:  # players refuse a playlist with no whole segment (hls.js, ffmpeg, Chromium's
            # own): at the start, wait for the first (bounded; the session's end ends it)
            await feed.wait_for(lambda: complete_segments(history) > 0, BLOCK_MAX_S)
        query, _ = _signed(request, parts, stream_id)
        text = playlist(history, timing, ended=feed.ended, query=query)
        headers = CORS | {"cache-control": "no-store"}
        release = held.pop_all().close
    return HeldResponse(text, release, media_type=PLAYLIST_TYPE, headers=headers)


@router.get("/v1/streams/{stream_id}/live/{name}", response_class=Response)
async def live_media(
    stream_id: str, name: str, request: Request, parts: WorkerParts, caller: Caller
) -> Response:
    feed = view_feed(request, parts, caller, stream_id, ended=True)
    media = media_named(name)  # 404 segment_not_found
    with ExitStack() as held:
        held.enter_context(feed.hls_request())
        state = _media_state(feed, media)
        waited = state == "wait"
        if waited:  # the hinted part: it is written within a part's time
            await feed.wait_for(lambda: _media_state(feed, media) != "wait", BLOCK_MAX_S)
            state = _media_state(feed, media)
        result = {"hit": "waited" if waited else "hit", "gone": "gone"}.get(state, "miss")
        parts.metrics.hls_media.labels(media.kind, result).inc()
        if state == "gone":
            raise NotFound(
                f"{name} of stream {stream_id} is no longer kept: the playlist has moved on",
                code="segment_gone",
            )
        if state != "hit":
            raise NotFound(f"stream {stream_id} has no {name}", code="segment_not_found")
        _, expires = _signed(request, parts, stream_id)
        headers = CORS | {"cache-control": _media_cache(expires)}
        pieces = media_pieces(feed.history, media)
        release = held.pop_all().close
    return MediaResponse(pieces, release, headers)


def _media_state(feed: LiveFeed, media: Media) -> str:
    return media_state(feed.history, media, ended=feed.ended)


def _media_cache(expires: int | None) -> str:
    if expires is None:
        return f"private, max-age={MEDIA_MAX_AGE_S}, immutable"
    max_age = max(0, min(MEDIA_MAX_AGE_S, expires - int(time.time())))
    return f"public, max-age={max_age}, immutable"
