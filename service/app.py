"""The worker's HTTP application: routes, error mapping, auth, lifecycle."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from framewire.client import __version__
from framewire.client.errors import FramewireError, Overloaded, host_error
from framewire.client.share import remove_abandoned_segments
from framewire.client.wire import (
    EncodeRequest,
    EncodeResponse,
    MediaInfo,
    ProbeRequest,
    ProbeResponse,
    RegisterCudaRegion,
    RegisterSystemRegion,
    error_code,
)
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .atomic import remove_stale_temps
from .connections import peer_of
from .cuda_source import CudaRuntime
from .decoder import ReferenceDecoder
from .encoder import Encoder
from .fdserver import FdServer
from .ffmpeg import ffmpeg_version
from .jobs import EncodeJobs
from .limits import cgroup_cpu_limit, cpu_quota_note, exposure_note
from .logs import RequestIds
from .media import probe
from .metrics import Metrics
from .paths import open_input, real_roots
from .peers import READ, Access
from .regions import CudaRegion, RegionRegistry
from .scheduler import Scheduler
from .server import DrainHook, Listeners, UnixListener
from .settings import Settings

log = logging.getLogger("framewire.app")


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


class RequestCounter:
    """Counts requests by route template and status. Plain ASGI on purpose: Starlette's
    BaseHTTPMiddleware wraps ``receive`` and hides client disconnects from the endpoints,
    which need them to cancel encodes."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
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


class BodyGuard:
    """Request bodies: at most ``limit`` bytes, and no read waits more than ``idle_s``.

    Over the limit is 413 ``body_too_large`` as JSON (framework limiters answer in
    plain text): a declared Content-Length over it is refused before anything is
    read; a body without one (chunked) fails its read once it passes the limit. A
    body that stops arriving fails its read after ``idle_s`` with 408
    ``request_timeout``, and the connection is closed. Once the body is complete,
    reads only wait for a disconnect and have no bound: an encode may take long.
    """

    def __init__(self, app: ASGIApp, limit: int, idle_s: float):
        self.app = app
        self.limit = limit
        self.idle_s = idle_s
        self.message = f"the request body is over {limit} bytes (FRAMEWIRE_MAX_BODY_BYTES)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            response = JSONResponse(error_body("body_too_large", self.message), 413)
            await response(scope, receive, send)
            return
        seen = 0
        complete = False

        async def guarded() -> Message:
            nonlocal seen, complete
            if complete:
                return await receive()
            try:
                async with asyncio.timeout(self.idle_s):
                    message = await receive()
            except TimeoutError:
                raise StarletteHTTPException(
                    408,
                    f"no request body bytes for {self.idle_s:g} s (FRAMEWIRE_IDLE_TIMEOUT_S)",
                    headers={"connection": "close"},
                ) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise StarletteHTTPException(413, self.message)
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, guarded, send)


# Routes that answer without the bearer token: probes by orchestrators.
OPEN_ROUTES = frozenset({"/healthz", "/readyz"})


class BearerAuth:
    """Every route but ``OPEN_ROUTES`` needs ``Authorization: Bearer <token>`` when a token
    is set: the API, ``/metrics``, and the docs and schema (``/docs``, ``/openapi.json``)."""

    def __init__(self, app: ASGIApp, token: str | None):
        self.app = app
        self.expected = None if token is None else f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.expected is None or scope["path"] in OPEN_ROUTES:
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("authorization", "").encode("latin-1", "replace")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        body = error_body("unauthorized", "missing or wrong bearer token")
        await JSONResponse(body, 401, headers={"www-authenticate": "Bearer"})(scope, receive, send)


def build(settings: Settings, listeners: Listeners) -> tuple[FastAPI, DrainHook]:
    """The worker's app on its bound listeners, and what to run when a drain begins."""
    app = create_app(settings, fd_listener=listeners.fd)
    return app, app.state.fd_server.stop_accepting


def create_app(
    settings: Settings | None = None, *, fd_listener: UnixListener | None = None
) -> FastAPI:
    settings = settings or Settings()
    encoder = Encoder.from_settings(settings)
    metrics = Metrics()
    cuda = CudaRuntime.start()  # None without a GPU; else warmed up now, not on a request
    regions = RegionRegistry(settings.shm_prefixes, cuda, max_regions=settings.max_regions)
    scheduler = Scheduler(
        settings.cpu_slots,
        settings.max_queue,
        gpu_budget=cuda.gpu_budget(lambda index: scheduler.gpu_held(index)) if cuda else None,
    )
    jobs = EncodeJobs(settings, encoder, regions, metrics, scheduler, cuda)
    fd_server = FdServer(settings, ReferenceDecoder(settings, encoder.ffmpeg, metrics), metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for path in remove_stale_temps(settings.output_roots):
            log.warning("removed %s, left by a worker that was killed", path)
        for key in remove_abandoned_segments():
            log.warning("removed shm segment %s, left by a client that was killed", key)
        if note := cpu_quota_note(settings.cpu_slots):
            log.warning(note)
        if note := exposure_note(settings):
            log.warning(note)
        await fd_server.start(fd_listener)
        try:
            yield
        finally:
            # The server has drained what finished within the grace period; the rest
            # is stopped before the fd server and the regions those requests use.
            await jobs.stop()
            await fd_server.close()
        regions.close()
        jobs.close()

    app = FastAPI(
        title="framewire",
        version=__version__,
        lifespan=lifespan,
    )
    app.state.settings, app.state.metrics, app.state.jobs = settings, metrics, jobs
    app.state.fd_server = fd_server

    def access(request: Request) -> Access:
        """Whom a request acts for: its peer, and whether it presented the token."""
        return Access(peer_of(request.scope), trusted=settings.token is not None)

    app.add_middleware(BodyGuard, limit=settings.max_body_bytes, idle_s=settings.idle_timeout_s)
    app.add_middleware(BearerAuth, token=settings.token)
    app.add_middleware(RequestCounter, metrics=metrics)
    app.add_middleware(RequestIds)  # outermost: whatever runs inside logs with the id

    @app.exception_handler(FramewireError)
    async def on_framewire_error(request: Request, exc: FramewireError) -> JSONResponse:
        headers = {"Retry-After": f"{exc.retry_after:.0f}"} if isinstance(exc, Overloaded) else None
        body = error_body(exc.code, exc.message, exc.detail)
        return JSONResponse(body, exc.status, headers=headers)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Still JSON, still a stable code; the host's own faults (no fd left, a full
        # disk) are named as such rather than as a 500.
        mapped = host_error(exc, "the request failed") if isinstance(exc, OSError) else None
        if mapped is not None:
            return JSONResponse(error_body(mapped.code, mapped.message), mapped.status)
        log.error("unexpected error serving %s", request.url.path, exc_info=exc)
        return JSONResponse(error_body("internal", f"internal error: {type(exc).__name__}"), 500)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Framework-level refusals (oversized or unparsable bodies, unknown routes) in
        # the same {"error", "code"} shape as everything else.
        code = HTTP_CODES.get(
            exc.status_code, "bad_request" if exc.status_code < 500 else "internal"
        )
        return JSONResponse(
            error_body(code, str(exc.detail)),
            exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else "invalid request"
        detail = [{"loc": e.get("loc"), "msg": e.get("msg"), "type": e.get("type")} for e in errors]
        return JSONResponse(error_body(error_code(errors), message, detail), 400)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        # On the event loop, needing no thread: it answers while every pool thread is busy.
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        def ffmpeg_runs() -> bool:
            try:
                argv = [encoder.ffmpeg, "-hide_banner", "-version"]
                return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                return False

        ok = await anyio.to_thread.run_sync(ffmpeg_runs)
        return JSONResponse({"ready": ok}, 200 if ok else 503)

    @app.get("/v1/info")
    def info() -> dict[str, object]:
        return {
            "version": __version__,
            "ffmpeg": encoder.ffmpeg,
            "ffmpeg_version": ffmpeg_version(encoder.ffmpeg),
            "device": "cuda" if cuda else "cpu",
            "cuda": cuda.info() if cuda else None,  # devices and their memory figures
            "limits": {
                "chunk_bytes": settings.chunk_bytes,
                "cpu_slots": settings.cpu_slots,
                "max_queue": settings.max_queue,
                "decode_cache_bytes": settings.decode_cache_bytes,
                "max_decode_bytes": settings.max_decode_bytes,
                "cgroup_cpu_quota": cgroup_cpu_limit(),
            },
            "sockets": {"uds": str(settings.uds), "fd_socket": str(settings.fd_socket)},
            "output_roots": settings.output_roots,
            "input_roots": settings.input_roots,
            "shm_prefixes": settings.shm_prefixes,
        }

    @app.get("/metrics")
    def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/videos:encode", response_model=EncodeResponse)
    async def encode(body: EncodeRequest, request: Request) -> JSONResponse:
        status, results = await jobs.run(body, request.is_disconnected, access(request))
        payload = EncodeResponse(outputs=results).model_dump(mode="json")
        if status != 200:
            failed = next(r for r in results if not r.ok)
            assert failed.error is not None
            payload |= error_body(failed.error.code, failed.error.message)
        return JSONResponse(payload, status)

    @app.post("/v1/probe", response_model=ProbeResponse)
    async def probe_files(body: ProbeRequest, request: Request) -> ProbeResponse:
        caller = access(request)
        roots = settings.input_roots + settings.output_roots

        def probe_one(raw: str) -> MediaInfo:
            with open_input(raw, roots) as source:
                target = os.fstat(source.fd)
                caller.check_path(Path(source.name), real_roots(roots), READ, raw, target)
                return probe(source)

        def run() -> ProbeResponse:
            return ProbeResponse(results=[probe_one(p) for p in body.paths])

        return await anyio.to_thread.run_sync(run)

    # --- Triton's system shared-memory extension -----------------------------------------
    @app.post("/v2/systemsharedmemory/region/{name}/register")
    def register(name: str, body: RegisterSystemRegion, request: Request) -> JSONResponse:
        regions.register(name, body.key, body.offset, body.byte_size, access(request))
        return JSONResponse({}, 200)

    @app.get("/v2/systemsharedmemory/status")
    def status_all() -> list[dict[str, object]]:
        return regions.status()

    @app.get("/v2/systemsharedmemory/region/{name}/status")
    def status_one(name: str) -> list[dict[str, object]]:
        return regions.status(name)

    @app.post("/v2/systemsharedmemory/unregister")
    async def unregister_all() -> JSONResponse:
        regions.unregister()  # on the loop, like leases: returns at once (Triton's semantics)
        return JSONResponse({}, 200)

    @app.post("/v2/systemsharedmemory/region/{name}/unregister")
    async def unregister_one(name: str) -> JSONResponse:
        regions.unregister(name)
        return JSONResponse({}, 200)

    # --- and its CUDA twin ---------------------------------------------------------------
    @app.post("/v2/cudasharedmemory/region/{name}/register")
    def register_cuda(name: str, body: RegisterCudaRegion) -> JSONResponse:
        regions.register_cuda(name, body.raw_handle.b64, body.device_id, body.byte_size)
        return JSONResponse({}, 200)

    @app.get("/v2/cudasharedmemory/status")
    def cuda_status_all() -> list[dict[str, object]]:
        return regions.status(kind=CudaRegion)

    @app.get("/v2/cudasharedmemory/region/{name}/status")
    def cuda_status_one(name: str) -> list[dict[str, object]]:
        return regions.status(name, kind=CudaRegion)

    @app.post("/v2/cudasharedmemory/unregister")
    async def cuda_unregister_all() -> JSONResponse:
        regions.unregister(kind=CudaRegion)
        return JSONResponse({}, 200)

    @app.post("/v2/cudasharedmemory/region/{name}/unregister")
    async def cuda_unregister_one(name: str) -> JSONResponse:
        regions.unregister(name, kind=CudaRegion)
        return JSONResponse({}, 200)

    return app
