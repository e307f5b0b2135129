"""Plain ASGI middleware: request counting, body limits and timeouts, the bearer token.

Plain ASGI on purpose: Starlette's BaseHTTPMiddleware wraps ``receive`` and hides
client disconnects from the endpoints, which need them to cancel encodes.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable

from fastapi.responses import JSONResponse
from framewire.service._http.errors import error_body
from framewire.service._ops.asgi import HttpMiddleware
from framewire.service._ops.metrics import Metrics
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Endpoints that answer without the bearer token: probes by orchestrators (Kubernetes's
# kubelet; Triton's health endpoints, which KServe deployments probe).
INSTANCE_HEADER = "framewire-instance"
OPEN_ROUTES = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})


class RequestCounter(HttpMiddleware):
    """Counts requests by route template and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        super().__init__(app)
        self.metrics = metrics

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(route, str(status)).inc()


class InstanceHeader(HttpMiddleware):
    """Names the worker process on every answer (``framewire-instance``, as ``/v1/info``
    does): a long-lived client tells a restarted worker from the one it opened a stream
    session with by the first answer it gets, without asking."""

    def __init__(self, app: ASGIApp, instance: str):
        super().__init__(app)
        self.header = (INSTANCE_HEADER.encode(), instance.encode())

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_named)


class BodyGuard(HttpMiddleware):
    """Request bodies: at most ``limit`` bytes, all of them within ``idle_s``.

    Over the limit is 413 ``body_too_large`` as JSON (framework limiters answer in
    plain text): a declared Content-Length over it is refused before anything is
    read; a body without one (chunked) fails its read once it passes the limit. A
    body not complete ``idle_s`` after its headers fails its read with 408
    ``request_timeout``, and the connection is closed: the bound is on the whole
    body, so one dribbled a byte at a time cannot hold a connection either. Once
    the body is complete, reads only wait for a disconnect and have no bound: an
    encode may take long.
    """

    def __init__(self, app: ASGIApp, limit: int, idle_s: float):
        super().__init__(app)
        self.limit = limit
        self.idle_s = idle_s
        self.message = f"the request body is over {limit} bytes (FRAMEWIRE_MAX_BODY_BYTES)"

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            response = JSONResponse(error_body("body_too_large", self.message), 413)
            await response(scope, receive, send)
            return
        seen = 0
        complete = False
        deadline = asyncio.get_running_loop().time() + self.idle_s

        async def guarded() -> Message:
            nonlocal seen, complete
            if complete:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise StarletteHTTPException(
                    408,
                    f"the request body did not arrive within {self.idle_s:g} s "
                    "(FRAMEWIRE_IDLE_TIMEOUT_S)",
                    headers={"connection": "close"},
                ) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise StarletteHTTPException(413, self.message)
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, guarded, send)


class BearerAuth(HttpMiddleware):
    """Every endpoint but ``OPEN_ROUTES`` needs ``Authorization: Bearer <token>`` when a token
    is set: the API, ``/metrics``, and the docs and schema (``/docs``, ``/openapi.json``).
    ``signed(path, query)`` lets a live view's endpoints go with a signed URL instead."""

    def __init__(
        self, app: ASGIApp, token: str | None, signed: Callable[[str, str], bool] | None = None
    ):
        super().__init__(app)
        self.expected = None if token is None else f"Bearer {token}".encode()
        self.signed = signed

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["path"] in OPEN_ROUTES:
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("authorization", "").encode("latin-1", "replace")
        query = scope.get("query_string", b"").decode("latin-1")
        if hmac.compare_digest(given, self.expected) or (
            self.signed is not None and self.signed(scope["path"], query)
        ):
            await self.app(scope, receive, send)
            return
        body = error_body("unauthorized", "missing or wrong bearer token")
        await JSONResponse(body, 401, headers={"www-authenticate": "Bearer"})(scope, receive, send)
