"""Health, readiness, what the worker is, and its metrics."""

from __future__ import annotations

import anyio
from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse
from framewire.client import __version__
from framewire.core.media.argv import PROFILES
from framewire.service._convert import kernels
from framewire.service._http.deps import WorkerParts
from framewire.service._ops.limits import cgroup_cpu_limit
from framewire.service._parts import Parts
from framewire.service._probe import pyav_build
from framewire.service._sources.cuda_faults import HEALTH
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter()


@router.get("/healthz")
async def healthz() -> JSONResponse:
    # On the event loop, needing no thread: it answers while every pool thread is busy.
    return JSONResponse(*_health())


def _health() -> tuple[dict[str, object], int]:
    """Alive, unless a sticky CUDA error poisoned a GPU's context: then 503, so that the
    supervisor restarts the worker (service/_sources/cuda_faults.py)."""
    lost = HEALTH.lost()
    if lost:
        return {
            "status": "cuda_device_unusable",
            "devices": {f"cuda:{i}": why for i, why in lost.items()},
        }, 503
    return {"status": "ok"}, 200


async def is_ready(parts: Parts) -> bool:
    """Whether the worker can encode now: no GPU of its is poisoned, its default ffmpeg
    runs. ``/readyz`` and
    Triton's ``/v2/health/ready`` both answer this, as cheaply as ``/healthz`` while the
    last answer holds (RUNS_TTL_S); then one ``-version`` runs on a thread for every
    caller, however many ask."""
    if HEALTH.lost():
        return False
    encoders = parts.encoder.encoders
    default = encoders.binaries[0]
    answer = encoders.check(default).fresh()
    if answer is not None:
        return answer
    return await anyio.to_thread.run_sync(encoders.runs, default)


@router.get("/readyz")
async def readyz(parts: WorkerParts) -> JSONResponse:
    ok = await is_ready(parts)
    return JSONResponse({"ready": ok}, 200 if ok else 503)


@router.get("/v1/info")
def info(parts: WorkerParts) -> dict[str, object]:
    settings, cuda = parts.settings, parts.cuda
    # Every encoder a request may name by its identity (docs/engines.md): each ffmpeg
    # binary (the default first) and PyAV, with the libx264 build each runs, and whether
    # it still runs.
    encoders = parts.encoder.encoders.describe()
    return {
        "version": __version__,
        "instance": parts.instance,
        "ffmpeg": parts.encoder.encoders.default_path,
        "ffmpeg_version": encoders[0].get("version"),
        "encoders": encoders,
        "decode_ffmpeg": parts.fd_server.decoder.ffmpeg,
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
        "conversion": kernels.active(),  # float32 -> rgb24: "compiled" or "pure"
        # The engine profiles, and the PyAV build the vllm-omni one encodes with (its
        # bytes equal the engine's only on the same build); None without PyAV.
        "profiles": list(PROFILES),
        "pyav": pyav_build(),
        "sockets": {"uds": str(settings.uds), "fd_socket": str(settings.fd_socket)},
        "output_roots": settings.output_roots,
        "input_roots": settings.input_roots,
        "shm_prefixes": settings.shm_prefixes,
        # Where outputs may be uploaded; never the store's endpoint or credentials.
        "output_urls": settings.output_urls,
    }


@router.get("/metrics")
def prometheus(parts: WorkerParts) -> PlainTextResponse:
    # Readiness as a scrape sees it (a thread of the pool: this route is sync).
    encoders = parts.encoder.encoders
    parts.metrics.ready.set(1 if encoders.runs(encoders.binaries[0]) and not HEALTH.lost() else 0)
    registry = parts.metrics.registry
    return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
