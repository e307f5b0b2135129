"""NVIDIA Triton's HTTP protocol, as far as a Triton client needs it: server metadata, the
health endpoints, and the shared-memory extension's region registry.

The same paths, bodies and status codes as Triton's, so ``tritonclient`` works
unchanged. Like Triton, the ``/v2`` routes read a request body as JSON whatever its
Content-Type says: ``tritonclient.http`` sends none, ``tritonclient.http.aio``
sends ``application/octet-stream``. Registration opens files or maps GPU memory: it
runs on a worker thread. Unregistering runs on the event loop, like the leases it
must not race, and returns at once (a region in use is released when its last user
ends).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from framewire.client import __version__
from framewire.core.wire import RegisterCudaRegion, RegisterSystemRegion
from framewire.service._http.deps import Caller, WorkerParts
from framewire.service._http.errors import error_body
from framewire.service._http.health import is_ready
from framewire.service._sources.cuda_faults import HEALTH
from framewire.service._sources.regions import CudaRegion, Region, SystemRegion
from starlette.datastructures import Headers

# What GET /v2 lists: the protocol extensions served here.
EXTENSIONS = ("system_shared_memory", "cuda_shared_memory")
JSON = (b"content-type", b"application/json")


class _JsonRequest(Request):
    """A request whose body is JSON, whatever (or whether) its Content-Type says so."""

    @property
    def headers(self) -> Headers:
        if not hasattr(self, "_json_headers"):
            raw = [(k, v) for k, v in self.scope["headers"] if k.lower() != b"content-type"]
            self._json_headers = Headers(raw=[*raw, JSON])
        return self._json_headers


class _JsonBodyRoute(APIRoute):
    """FastAPI reads a body as JSON only under a JSON Content-Type; Triton always does.
    A body that is not JSON still gets FastAPI's own refusal: 400, ``json_invalid``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def as_json(request: Request) -> Response:
            return await handle(_JsonRequest(request.scope, request.receive))

        return as_json


router = APIRouter(route_class=_JsonBodyRoute)
# Triton answers a successful register or unregister with an empty object.
OK: dict[str, object] = {}


@router.get("/v2")
async def server_metadata() -> dict[str, object]:
    return {"name": "framewire", "version": __version__, "extensions": list(EXTENSIONS)}


@router.get("/v2/health/live")
async def live() -> Response:
    # Triton's answer: the status alone (200: live), with an empty body; as /healthz,
    # not live once a sticky CUDA error poisoned a GPU (a restart recovers it).
    return Response(status_code=200 if not HEALTH.lost() else 503)


@router.get("/v2/health/ready")
async def ready(parts: WorkerParts) -> Response:
    if await is_ready(parts):
        return Response(status_code=200)
    # Triton's protocol says "not ready" with a 4xx; Triton itself answers 400.
    why = "a GPU is unusable until a restart" if HEALTH.lost() else "its ffmpeg does not run"
    return JSONResponse(error_body("not_ready", f"the worker is not ready: {why}"), 400)


@router.post("/v2/systemsharedmemory/region/{name}/register")
def register_system(
    name: str, body: RegisterSystemRegion, parts: WorkerParts, caller: Caller
) -> JSONResponse:
    parts.regions.register(name, body.key, body.offset, body.byte_size, caller)
    return JSONResponse(OK)


@router.post("/v2/cudasharedmemory/region/{name}/register")
def register_cuda(
    name: str, body: RegisterCudaRegion, parts: WorkerParts, caller: Caller
) -> JSONResponse:
    regions = parts.regions
    regions.register_cuda(
        name, body.raw_handle.b64, body.device_id, body.byte_size, caller, body.device_uuid
    )
    return JSONResponse(OK)


def _status_and_unregister(prefix: str, kind: type[Region]) -> None:
    """The four routes each kind has: status of all or one, unregister all or one. Each
    sees and removes only what the caller owns (docs/SECURITY.md)."""

    @router.get(f"/v2/{prefix}/status", name=f"{prefix}_status")
    def status_all(parts: WorkerParts, caller: Caller) -> list[dict[str, object]]:
        return parts.regions.status(kind=kind, access=caller)

    @router.get(f"/v2/{prefix}/region/{{name}}/status", name=f"{prefix}_region_status")
    def status_one(name: str, parts: WorkerParts, caller: Caller) -> list[dict[str, object]]:
        return parts.regions.status(name, kind=kind, access=caller)

    @router.post(f"/v2/{prefix}/unregister", name=f"{prefix}_unregister")
    async def unregister_all(parts: WorkerParts, caller: Caller) -> JSONResponse:
        parts.regions.unregister(kind=kind, access=caller)
        return JSONResponse(OK)

    @router.post(f"/v2/{prefix}/region/{{name}}/unregister", name=f"{prefix}_region_unregister")
    async def unregister_one(name: str, parts: WorkerParts, caller: Caller) -> JSONResponse:
        parts.regions.unregister(name, kind=kind, access=caller)
        return JSONResponse(OK)


_status_and_unregister("systemsharedmemory", SystemRegion)
_status_and_unregister("cudasharedmemory", CudaRegion)
