"""Encoding outputs and probing files."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from framewire.core.wire import (
    EncodeRequest,
    EncodeResponse,
    MediaInfo,
    ProbeRequest,
    ProbeResponse,
)
from framewire.service._access.paths import open_input, real_roots
from framewire.service._access.peers import READ
from framewire.service._http.deps import Caller, WorkerParts
from framewire.service._http.errors import error_body
from framewire.service._probe import probe

router = APIRouter()


@router.post("/v1/videos:encode", response_model=EncodeResponse)
async def encode(
    body: EncodeRequest, request: Request, parts: WorkerParts, caller: Caller
) -> JSONResponse:
    status, results = await parts.jobs.run(body, request.is_disconnected, caller)
    payload = EncodeResponse(outputs=results).model_dump(mode="json")
    if status != 200:
        failed = next(r for r in results if not r.ok)
        assert failed.error is not None
        payload |= error_body(failed.error.code, failed.error.message)
    return JSONResponse(payload, status)


@router.post("/v1/probe", response_model=ProbeResponse)
async def probe_files(body: ProbeRequest, parts: WorkerParts, caller: Caller) -> ProbeResponse:
    roots = parts.settings.input_roots + parts.settings.output_roots

    def probe_one(raw: str) -> MediaInfo:
        with open_input(raw, roots) as source:
            target = os.fstat(source.fd)
            caller.check_path(Path(source.name), real_roots(roots), READ, raw, target)
            return probe(source)

    def run() -> ProbeResponse:
        return ProbeResponse(results=[probe_one(p) for p in body.paths])

    return await anyio.to_thread.run_sync(run)
