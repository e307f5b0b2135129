"""The worker's HTTP application: routes, error mapping, auth, lifecycle."""

from __future__ import annotations

import hmac
import logging
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from framewire.client import __version__
from framewire.client.errors import Forbidden, FramewireError, Overloaded
from framewire.client.share import remove_abandoned_segments
from framewire.client.wire import (
    EncodeRequest,
    EncodeResponse,
    ProbeRequest,
    ProbeResponse,
    error_code,
)
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .atomic import remove_stale_temps
from .cuda_source import CudaRuntime
from .decoder import ReferenceDecoder
from .encoder import Encoder
from .fdserver import FdServer
from .ffmpeg import ffmpeg_version
from .jobs import EncodeJobs
from .limits import cgroup_cpu_limit, cpu_quota_note
from .logs import RequestIds
from .media import probe
from .metrics import Metrics
from .paths import resolve_input
from .regions import CudaRegion, RegionRegistry
from .scheduler import Scheduler
from .settings import Settings

log = logging.getLogger("framewire.app")


HTTP_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
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


class BodyLimit:
    """Refuses request bodies over ``limit`` bytes with 413 ``body_too_large`` as JSON.

    Framework limiters answer in plain text. A declared Content-Length over the limit
    is refused before anything is read; a body without one (chunked) fails its read
    once it passes the limit, and the error handlers answer it like any other.
    """

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit
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

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise StarletteHTTPException(413, self.message)
            return message

        await self.app(scope, limited, send)


class RegisterSystem(BaseModel):
    key: str
    offset: int = Field(default=0, ge=0)
    byte_size: int = Field(gt=0)


class RawHandle(BaseModel):
    b64: str


class RegisterCuda(BaseModel):
    raw_handle: RawHandle
    device_id: int = Field(ge=0)
    byte_size: int = Field(gt=0)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    encoder = Encoder(settings.ffmpeg, chunk_bytes=settings.chunk_bytes, fallback=settings.fallback)
    metrics = Metrics()
    cuda = CudaRuntime.start()  # None without a GPU; else warmed up now, not on a request
    regions = RegionRegistry(settings.shm_prefixes, cuda)
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
        await fd_server.start()
        try:
            yield
        finally:
            # The server has drained what finished within the grace period; the rest
            # is stopped before the fd server and the regions those requests use.
            await jobs.stop()
            await fd_server.close()
        await regions.close()
        jobs.close()

    app = FastAPI(
        title="framewire",
        version=__version__,
        lifespan=lifespan,
    )
    app.state.settings, app.state.metrics, app.state.jobs = settings, metrics, jobs
    app.state.fd_server = fd_server

    async def authorize(request: Request) -> None:
        # async on purpose: FastAPI runs a sync dependency on a thread, a hop per request.
        if settings.token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {settings.token}".encode()):
            raise Forbidden("missing or wrong bearer token", code="unauthorized")

    auth = [Depends(authorize)]

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(RequestCounter, metrics=metrics)
    app.add_middleware(RequestIds)  # outermost: whatever runs inside logs with the id

    @app.exception_handler(FramewireError)
    async def on_framewire_error(request: Request, exc: FramewireError) -> JSONResponse:
        status = 401 if exc.code == "unauthorized" else exc.status
        headers = {"Retry-After": f"{exc.retry_after:.0f}"} if isinstance(exc, Overloaded) else None
        return JSONResponse(error_body(exc.code, exc.message, exc.detail), status, headers=headers)

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
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        try:
            ok = (
                subprocess.run(
                    [encoder.ffmpeg, "-hide_banner", "-version"], capture_output=True, timeout=10
                ).returncode
                == 0
            )
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        return JSONResponse({"ready": ok}, 200 if ok else 503)

    @app.get("/v1/info", dependencies=auth)
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

    @app.get("/metrics", dependencies=auth)
    def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/videos:encode", dependencies=auth, response_model=EncodeResponse)
    async def encode(body: EncodeRequest, request: Request) -> JSONResponse:
        status, results = await jobs.run(body, request.is_disconnected)
        payload = EncodeResponse(outputs=results).model_dump(mode="json")
        if status != 200:
            failed = next(r for r in results if not r.ok)
            assert failed.error is not None
            payload |= error_body(failed.error.code, failed.error.message)
        return JSONResponse(payload, status)

    @app.post("/v1/probe", dependencies=auth, response_model=ProbeResponse)
    async def probe_files(body: ProbeRequest) -> ProbeResponse:
        def run() -> ProbeResponse:
            roots = settings.input_roots + settings.output_roots
            return ProbeResponse(results=[probe(resolve_input(p, roots)) for p in body.paths])

        return await anyio.to_thread.run_sync(run)

    # --- Triton's system shared-memory extension -----------------------------------------
    @app.post("/v2/systemsharedmemory/region/{name}/register", dependencies=auth)
    def register(name: str, body: RegisterSystem) -> JSONResponse:
        regions.register(name, body.key, body.offset, body.byte_size)
        return JSONResponse({}, 200)

    @app.get("/v2/systemsharedmemory/status", dependencies=auth)
    def status_all() -> list[dict[str, object]]:
        return regions.status()

    @app.get("/v2/systemsharedmemory/region/{name}/status", dependencies=auth)
    def status_one(name: str) -> list[dict[str, object]]:
        return regions.status(name)

    @app.post("/v2/systemsharedmemory/unregister", dependencies=auth)
    async def unregister_all() -> JSONResponse:
        await regions.unregister()
        return JSONResponse({}, 200)

    @app.post("/v2/systemsharedmemory/region/{name}/unregister", dependencies=auth)
    async def unregister_one(name: str) -> JSONResponse:
        await regions.unregister(name)
        return JSONResponse({}, 200)

    # --- and its CUDA twin ---------------------------------------------------------------
    @app.post("/v2/cudasharedmemory/region/{name}/register", dependencies=auth)
    def register_cuda(name: str, body: RegisterCuda) -> JSONResponse:
        regions.register_cuda(name, body.raw_handle.b64, body.device_id, body.byte_size)
        return JSONResponse({}, 200)

    @app.get("/v2/cudasharedmemory/status", dependencies=auth)
    def cuda_status_all() -> list[dict[str, object]]:
        return regions.status(kind=CudaRegion)

    @app.get("/v2/cudasharedmemory/region/{name}/status", dependencies=auth)
    def cuda_status_one(name: str) -> list[dict[str, object]]:
        return regions.status(name, kind=CudaRegion)

    @app.post("/v2/cudasharedmemory/unregister", dependencies=auth)
    async def cuda_unregister_all() -> JSONResponse:
        await regions.unregister(kind=CudaRegion)
        return JSONResponse({}, 200)

    @app.post("/v2/cudasharedmemory/region/{name}/unregister", dependencies=auth)
    async def cuda_unregister_one(name: str) -> JSONResponse:
        await regions.unregister(name, kind=CudaRegion)
        return JSONResponse({}, 200)

    return app
