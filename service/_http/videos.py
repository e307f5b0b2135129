"""Encoding outputs and probing files."""

from __future__ import annotations

import asyncio
import os
import re
import time
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
SHARE_ID = re.compile(r"[0-9a-f]{32}")


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


RELEASE_WAIT_S = 60.0  # the longest a release waits for a share to be closed


@router.post("/v1/cuda/shares/{share_id}/release")
async def release_share(share_id: str, parts: WorkerParts, wait_s: float = 30.0) -> JSONResponse:
    """Let go of the producer's CUDA share ``share_id`` for good, once nothing here holds
    it open (service/_sources/cuda_shares.py): ``released`` false if it still was after
    ``wait_s``."""
    if not SHARE_ID.fullmatch(share_id):
        return JSONResponse(error_body("bad_share_id", "a share id is 32 hex digits"), 400)
    shares = parts.resources.prepare.shares
    deadline = time.monotonic() + min(max(wait_s, 0.0), RELEASE_WAIT_S)
    while not (released := shares.release(share_id)) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return JSONResponse({"released": released})
