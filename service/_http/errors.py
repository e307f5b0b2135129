"""Every refusal as ``{"error", "code"}`` JSON, whoever raises it: framewire, the framework,
request validation, or something unexpected (then ``500 internal``)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from framewire.core.errors import FramewireError, host_error
from framewire.core.wire import refusal
from framewire.service._ops.asgi import HttpMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Receive, Scope, Send

log = logging.getLogger("framewire.http")

# The codes of the framework's own refusals.
HTTP_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "body_too_large",
    415: "unsupported_media_type",
}


def error_body(code: str, message: str, detail: object = None) -> dict[str, object]:
    body: dict[str, object] = {"error": message, "code": code}
    if detail is not None:
        body["detail"] = detail
    return body


def error_response(exc: FramewireError) -> JSONResponse:
    # An error is never kept by a cache (an HTTP cache in front of the live view's HLS
    # would otherwise keep a 404 for a part not written yet).
    headers = {"cache-control": "no-store"}
    if exc.retry_after is not None:
        headers["Retry-After"] = f"{exc.retry_after:.0f}"
    return JSONResponse(error_body(exc.code, exc.message, exc.detail), exc.status, headers=headers)


def unexpected_response(path: str, exc: Exception) -> JSONResponse:
    """The answer to an error nothing else caught: the host's own faults (no fd left, a
    full disk) named as such, anything else ``500 internal`` (and logged)."""
    mapped = host_error(exc, "the request failed") if isinstance(exc, OSError) else None
    if mapped is not None:
        return error_response(mapped)
    log.error("unexpected error serving %s", path, exc_info=exc)
    return JSONResponse(error_body("internal", f"internal error: {type(exc).__name__}"), 500)


class Unexpected(HttpMiddleware):
    """Answers an unexpected error and keeps the connection: Starlette's outermost handler
    (``exception_handler(Exception)``) answers too, but then raises the error on to the
    server, and uvicorn closes a connection whose application raised: the client's next
    request on that keep-alive connection failed. Raised again only when the response
    had begun: half an answer can only be ended by closing the connection."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            await unexpected_response(scope["path"], exc)(scope, receive, send)


def install(app: FastAPI) -> None:
    """The error handlers; add :class:`Unexpected` as the innermost middleware."""

    @app.exception_handler(FramewireError)
    async def on_framewire_error(request: Request, exc: FramewireError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # What the middleware outside Unexpected raises (this connection then closes).
        return unexpected_response(request.url.path, exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = HTTP_CODES.get(
            exc.status_code, "bad_request" if exc.status_code < 500 else "internal"
        )
        headers = getattr(exc, "headers", None)
        return JSONResponse(error_body(code, str(exc.detail)), exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        refused = refusal(errors)
        detail = [{"loc": e.get("loc"), "msg": e.get("msg"), "type": e.get("type")} for e in errors]
        return JSONResponse(error_body(refused.code, refused.message, detail), 400)
