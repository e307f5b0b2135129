"""NVIDIA Triton's shared-memory extension: the region registry over HTTP.

The same paths, bodies and status codes as Triton's ``/v2/systemsharedmemory``
and ``/v2/cudasharedmemory`` routes, so a Triton client's region calls work.
Registration opens files or maps GPU memory: it runs on a worker thread.
Unregistering runs on the event loop, like the leases it must not race, and
returns at once (a region in use is released when its last user ends).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from framewire.client.wire import RegisterCudaRegion, RegisterSystemRegion
from framewire.service._http.deps import Caller, WorkerParts
from framewire.service._sources.regions import CudaRegion, Region, SystemRegion

router = APIRouter()
# Triton answers a successful register or unregister with an empty object.
OK: dict[str, object] = {}


@router.post("/v2/systemsharedmemory/region/{name}/register")
def register_system(
    name: str, body: RegisterSystemRegion, parts: WorkerParts, caller: Caller
) -> JSONResponse:
    parts.regions.register(name, body.key, body.offset, body.byte_size, caller)
    return JSONResponse(OK)


@router.post("/v2/cudasharedmemory/region/{name}/register")
def register_cuda(name: str, body: RegisterCudaRegion, parts: WorkerParts) -> JSONResponse:
    parts.regions.register_cuda(name, body.raw_handle.b64, body.device_id, body.byte_size)
    return JSONResponse(OK)


def _status_and_unregister(prefix: str, kind: type[Region]) -> None:
    """The four routes each kind has: status of all or one, unregister all or one."""

    @router.get(f"/v2/{prefix}/status", name=f"{prefix}_status")
    def status_all(parts: WorkerParts) -> list[dict[str, object]]:
        return parts.regions.status(kind=kind)

    @router.get(f"/v2/{prefix}/region/{{name}}/status", name=f"{prefix}_region_status")
    def status_one(name: str, parts: WorkerParts) -> list[dict[str, object]]:
        return parts.regions.status(name, kind=kind)

    @router.post(f"/v2/{prefix}/unregister", name=f"{prefix}_unregister")
    async def unregister_all(parts: WorkerParts) -> JSONResponse:
        parts.regions.unregister(kind=kind)
        return JSONResponse(OK)

    @router.post(f"/v2/{prefix}/region/{{name}}/unregister", name=f"{prefix}_region_unregister")
    async def unregister_one(name: str, parts: WorkerParts) -> JSONResponse:
        parts.regions.unregister(name, kind=kind)
        return JSONResponse(OK)


_status_and_unregister("systemsharedmemory", SystemRegion)
_status_and_unregister("cudasharedmemory", CudaRegion)
