"""The live view over HTTP: the byte stream of a session's encode, and its watch page.

``GET /v1/streams/{id}/live.mp4`` answers one continuous fragmented MP4 in a
chunked response: the init segment, every fragment so far, then each new one as
ffmpeg writes it, and a ``free`` box naming why it ended (live.py). Plain HTTP
on purpose: the bearer token and peer rules apply as to every route, any HTTP
client or player reads it (``ffplay``, ``curl``), and the page reads it with
``fetch`` streams; a WebSocket would add a protocol, a dependency and a second
set of access rules for nothing a viewer needs.
"""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, StreamingResponse
from framewire.core.errors import Conflict, Forbidden
from framewire.service._access.peers import Access
from framewire.service._http.deps import Caller, WorkerParts
from framewire.service._http.watch_page import watch_page
from framewire.service._parts import Parts
from framewire.service._stream.live import LiveFeed, Viewer
from starlette.types import Receive, Scope, Send

router = APIRouter()

NO_STORE = {"cache-control": "no-store", "x-content-type-options": "nosniff"}


def view_url(request: Request, parts: Parts, stream_id: str, route: str = "watch") -> str:
    """A signed URL of a live view's ``route`` (the watch page, ``live.m3u8``), on the
    address this request came to (TCP), else on the worker's TCP listener (a Unix
    socket is no address for a browser or a player)."""
    server = request.scope.get("server")
    if server is not None and isinstance(server[1], int):
        base = str(request.base_url).rstrip("/")
    else:
        host, port = getattr(request.app.state, "tcp_address", (parts.settings.host, 0))
        host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        host = f"[{host}]" if ":" in host else host
        base = f"http://{host}:{port or parts.settings.port}"
    query = parts.sessions.signer.query(stream_id)
    return f"{base}/v1/streams/{stream_id}/{route}?{query}"


def view_feed(
    request: Request, parts: Parts, caller: Access, stream_id: str, *, ended: bool = False
) -> LiveFeed:
    """The live view a request may watch (``ended``: also one whose session has ended,
    within its grace). A signed URL is the opener's way to hand it to another (a
    browser, another user): it opens the view to whoever holds it. Without one, the
    view is its session's, as its other routes are: to a caller who is neither the
    opener nor an admin it does not exist (404 ``stream_not_found``)."""
    sessions = parts.sessions
    query = request.url.query
    if "sig=" not in query:
        sessions.check_owner(stream_id, caller)
    elif not sessions.signer.valid(stream_id, query):
        raise Forbidden(
            "the view URL's signature is wrong or has expired: ask for a new one",
            code="view_url_invalid",
        )
    # 404 stream_not_found, 409 stream_closed
    feed = sessions.live_feed(stream_id) if ended else sessions.get(stream_id).live
    if feed is None:
        raise Conflict(
            f'stream {stream_id} was opened without a live view ("live": true)',
            code="live_not_enabled",
        )
    return feed


class ViewerResponse(StreamingResponse):
    """One viewer's byte stream. The viewer leaves (its slot freed) when the response is
    over however it ends, its body begun or not: a client gone before the headers went
    out never starts the body, and would otherwise hold its slot for good."""

    def __init__(self, feed: LiveFeed, viewer: Viewer):
        super().__init__(viewer.stream(), media_type="video/mp4", headers=NO_STORE)
        self._feed, self._viewer = feed, viewer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._feed.leave(self._viewer)


@router.get("/v1/streams/{stream_id}/live.mp4", response_class=StreamingResponse)
async def live_mp4(
    stream_id: str, request: Request, parts: WorkerParts, caller: Caller
) -> StreamingResponse:
    feed = view_feed(request, parts, caller, stream_id)
    return ViewerResponse(feed, feed.join())  # 429 too_many_viewers, 409 live_history_full


@router.get("/v1/streams/{stream_id}/watch", response_class=HTMLResponse)
async def watch(
    stream_id: str, request: Request, parts: WorkerParts, caller: Caller
) -> HTMLResponse:
    view_feed(request, parts, caller, stream_id)
    nonce = secrets.token_urlsafe(16)
    policy = (
        f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
        "connect-src 'self'; media-src blob: 'self'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    headers = NO_STORE | {"content-security-policy": policy, "referrer-policy": "no-referrer"}
    return HTMLResponse(watch_page(stream_id, nonce), headers=headers)
