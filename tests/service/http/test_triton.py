"""Triton's HTTP protocol as tritonclient 2.73.0 speaks it, against a real worker.

Both of tritonclient's HTTP clients (``tritonclient.http`` over geventhttpclient, which
sends its JSON bodies without a Content-Type, and ``tritonclient.http.aio`` over aiohttp,
which sends ``application/octet-stream``) are called exactly as a Triton user calls
them: discovery, health, system regions created and filled with
``tritonclient.utils.shared_memory``, CUDA regions (refused here: no GPU), the errors,
an encode from a region tritonclient made, and an unregister while that region is read.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import tritonclient.http
import tritonclient.http.aio
import tritonclient.utils.shared_memory as shm
from framewire.client import __version__
from tritonclient.utils import InferenceServerException

from tests.support.http import http_client
from tests.support.media import make_clip, reference_mp4, sha256
from tests.support.requests import Request, encode_body, wait_for_ffmpeg
from tests.support.segments import shm_source
from tests.support.worker import Worker

# tritonclient's own examples name keys like /input_simple: a Triton user adds their
# prefix to the worker's (FRAMEWIRE_SHM_PREFIXES), as this module's worker does.
PREFIX = "/tritontest-"
WORKER_ARGS = ("--shm-prefixes", f"/framewire,{PREFIX}")
EXTENSIONS = ["system_shared_memory", "cuda_shared_memory"]


class Triton:
    """One of tritonclient's HTTP clients behind plain calls: ``tritonclient.http``'s as
    they are; ``tritonclient.http.aio``'s coroutines each run to completion on a loop of
    its own. Every method is tritonclient's, called with the caller's arguments."""

    def __init__(self, flavour: str, url: str):
        self.flavour = flavour
        self._loop: asyncio.AbstractEventLoop | None = None
        if flavour == "http":
            self._client: Any = tritonclient.http.InferenceServerClient(url)
        else:
            self._loop = asyncio.new_event_loop()

            async def make() -> Any:  # aiohttp wants its session made on a running loop
                return tritonclient.http.aio.InferenceServerClient(url)

            self._client = self._loop.run_until_complete(make())

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._client, name)
        if self._loop is None:
            return method
        loop = self._loop
        return lambda *args, **kw: loop.run_until_complete(method(*args, **kw))

    def close(self) -> None:
        if self._loop is None:
            self._client.close()
        else:
            self._loop.run_until_complete(self._client.close())
            self._loop.close()


def connect(worker: Worker, flavour: str) -> Triton:
    return Triton(flavour, f"127.0.0.1:{worker.port}")


@pytest.fixture(params=["http", "aio"])
def triton(request: pytest.FixtureRequest, worker: Worker) -> Iterator[Triton]:
    client = connect(worker, request.param)
    yield client
    client.close()


@pytest.fixture
def regions() -> Iterator[Callable[[str, int], Any]]:
    """Regions made with tritonclient.utils.shared_memory (keys under PREFIX); destroyed
    after the test, which unlinks their segments."""
    made: list[Any] = []

    def create(name: str, byte_size: int) -> Any:
        handle = shm.create_shared_memory_region(
            name, f"{PREFIX}{secrets.token_hex(6)}", byte_size, create_only=True
        )
        made.append(handle)
        return handle

    yield create
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def refused(call: Callable[[], object]) -> tuple[str | None, str]:
    """(HTTP status, message) of the error tritonclient raises for ``call``."""
    with pytest.raises(InferenceServerException) as err:
        call()
    return err.value.status(), err.value.message()


def region_fds(worker: Worker, key: str) -> int:
    return sum(1 for f in worker.open_fds() if f == f"/dev/shm{key}")


# --- discovery and health ---------------------------------------------------------------------


def test_health_and_server_metadata(triton):
    assert triton.is_server_live() is True
    assert triton.is_server_ready() is True
    assert triton.get_server_metadata() == {
        "name": "framewire",
        "version": __version__,
        "extensions": EXTENSIONS,
    }


@pytest.mark.parametrize("flavour", ["http", "aio"])
def test_a_worker_whose_ffmpeg_does_not_run_is_live_but_not_ready(workers, tmp_path, flavour):
    broken = tmp_path / "ffmpeg"  # there, but it does not run
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    w = workers.start("--ffmpeg", str(broken))
    client = connect(w, flavour)
    try:
        assert client.is_server_live() is True
        assert client.is_server_ready() is False
    finally:
        client.close()
    with w.http() as h:  # the same answer as the worker's own readiness route
        assert h.get("/readyz").status_code == 503
        r = h.get("/v2/health/ready")
        assert (r.status_code, r.json()["code"]) == (400, "not_ready")


@pytest.mark.parametrize("flavour", ["http", "aio"])
def test_the_token_guards_all_but_the_health_routes(workers, flavour):
    w = workers.start("--token", "tr1ton")
    client = connect(w, flavour)
    auth = {"Authorization": "Bearer tr1ton"}
    try:
        assert client.is_server_live() is True and client.is_server_ready() is True
        assert refused(client.get_server_metadata)[0] == "401"
        assert refused(client.get_system_shared_memory_status)[0] == "401"
        assert client.get_server_metadata(headers=auth)["name"] == "framewire"
        assert client.get_system_shared_memory_status(headers=auth) == []
    finally:
        client.close()


# --- system shared memory ---------------------------------------------------------------------


def test_system_regions_register_status_unregister(triton, regions):
    a, b = regions("a", 4096), regions("b", 8192)
    triton.register_system_shared_memory("a", a._shm_key, 4096)
    triton.register_system_shared_memory("b", b._shm_key, 4096, offset=4096)
    assert triton.get_system_shared_memory_status() == [
        {"name": "a", "key": a._shm_key, "offset": 0, "byte_size": 4096},
        {"name": "b", "key": b._shm_key, "offset": 4096, "byte_size": 4096},
    ]
    assert triton.get_system_shared_memory_status(region_name="b") == [
        {"name": "b", "key": b._shm_key, "offset": 4096, "byte_size": 4096}
    ]
    # A name is registered once, as in Triton.
    status, message = refused(lambda: triton.register_system_shared_memory("a", a._shm_key, 16))
    assert status == "400" and "already in manager" in message
    triton.unregister_system_shared_memory("a")
    assert [r["name"] for r in triton.get_system_shared_memory_status()] == ["b"]
    status, message = refused(lambda: triton.get_system_shared_memory_status(region_name="a"))
    assert status == "404" and "unable to find" in message
    triton.unregister_system_shared_memory("never-registered")  # not an error, as in Triton
    triton.unregister_system_shared_memory()  # all of them
    assert triton.get_system_shared_memory_status() == []


def test_system_region_errors(triton, regions):
    handle = regions("small", 1024)
    key = handle._shm_key
    cases = {
        # Outside the worker's key prefixes (tritonclient's examples' /input_simple, say).
        "prefix": (("p", "/input_simple", 16), "403", "lacks an allowed prefix"),
        # framewire answers 404 for a missing segment (Triton: 500).
        "missing": (("m", f"{PREFIX}none-{secrets.token_hex(4)}", 16), "404", "no shared-memory"),
        "bounds": (("o", key, 1024, 1), "400", "exceeds segment"),
        "size": (("z", key, 0), "400", "byte_size"),
        "not a key": (("k", "no-slash", 16), "400", "not of the form /name"),
    }
    for what, (args, status, text) in cases.items():
        got_status, message = refused(lambda a=args: triton.register_system_shared_memory(*a))
        assert (got_status, text in message) == (status, True), (what, got_status, message)
    assert triton.get_system_shared_memory_status() == []
    assert triton.is_server_ready() is True  # the worker keeps serving


def test_cuda_regions_answer_clearly_without_a_gpu(triton):
    """This worker has no GPU: registering is refused with a clear 400; status and
    unregister work on the empty registry as Triton's do."""
    status, message = refused(
        lambda: triton.register_cuda_shared_memory("gpu", b"AAAA", device_id=0, byte_size=64)
    )
    assert status == "400" and "no CUDA device" in message
    assert triton.get_cuda_shared_memory_status() == []
    status, message = refused(lambda: triton.get_cuda_shared_memory_status(region_name="gpu"))
    assert status == "404" and "'gpu'" in message
    triton.unregister_cuda_shared_memory("gpu")
    triton.unregister_cuda_shared_memory()


# --- encodes from tritonclient's regions ------------------------------------------------------


def region_source(name: str, clip: torch.Tensor) -> dict[str, Any]:
    source = shm_source("", clip) | {"kind": "region", "region": name}
    del source["key"]
    return source


def test_an_encode_from_a_region_tritonclient_filled_is_byte_exact(triton, regions, worker,
                                                                    tmp_path):  # fmt: skip
    clip = make_clip(frames=6, height=48, width=64)
    frames = clip.numpy()
    handle = regions("frames", frames.nbytes)
    shm.set_shared_memory_region(handle, [frames])
    triton.register_system_shared_memory("frames", handle._shm_key, frames.nbytes)
    path = f"triton-{triton.flavour}.mp4"
    with worker.http() as h:
        r = h.post("/v1/videos:encode", json=encode_body(region_source("frames", clip), path))
    assert r.status_code == 200, r.text
    expected = reference_mp4(clip, tmp_path / "ref.mp4")
    assert r.json()["outputs"][0]["sha256"] == expected == sha256(worker.outputs / path)
    triton.unregister_system_shared_memory("frames")
    (worker.outputs / path).unlink()


def test_unregister_returns_at_once_and_the_segment_goes_with_its_last_user(
    triton, regions, worker, tmp_path
):
    """Triton's semantics: unregistering a region an encode reads returns at once and the
    region is gone from the status; the worker lets go of the segment when that encode
    ends, and the encode's output is byte-exact all the same. The encode's ffmpeg is
    held stopped meanwhile, so the encode is surely still running."""
    clip = make_clip(frames=48, height=256, width=256)  # long enough to be caught running
    frames = clip.numpy()
    handle = regions("busy", frames.nbytes)
    shm.set_shared_memory_region(handle, [frames])
    key = handle._shm_key
    triton.register_system_shared_memory("busy", key, frames.nbytes)
    path = f"busy-{triton.flavour}.mp4"
    request = Request(worker, "POST", "/v1/videos:encode",
                      json=encode_body(region_source("busy", clip), path))  # fmt: skip
    ffmpegs = wait_for_ffmpeg(worker)
    for pid in ffmpegs:
        os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        triton.unregister_system_shared_memory("busy")
        assert time.monotonic() - started < 1.0
        assert triton.get_system_shared_memory_status() == []
        assert request.is_alive() and region_fds(worker, key) == 1  # still the encode's
        with worker.http() as h:  # no new user finds it
            late = encode_body(region_source("busy", clip), "late.mp4")
            r = h.post("/v1/videos:encode", json=late)
            assert (r.status_code, r.json()["code"]) == (404, "region_not_found")
    finally:
        for pid in ffmpegs:
            os.kill(pid, signal.SIGCONT)
    response = request.result(timeout=60)
    assert response.status_code == 200, response.text
    assert sha256(worker.outputs / path) == reference_mp4(clip, tmp_path / "ref.mp4")
    assert region_fds(worker, key) == 0  # released with its last user
    (worker.outputs / path).unlink()


# --- the body, whatever its Content-Type ------------------------------------------------------


@pytest.mark.parametrize(
    "content_type", [None, "application/octet-stream", "application/json", "text/plain"]
)
def test_register_bodies_are_json_whatever_the_content_type(worker, regions, content_type):
    handle = regions("ct", 64)
    headers = {} if content_type is None else {"content-type": content_type}
    cuda = {"raw_handle": {"b64": "AAAA"}, "device_id": 0}
    # route -> (a valid body and its answer, a body with a bad field)
    routes = {
        "/v2/systemsharedmemory/region/ct/register": (
            {"key": handle._shm_key, "byte_size": 64}, (200, None), {"key": "/x", "byte_size": 0}
        ),
        "/v2/cudasharedmemory/region/ct/register": (
            cuda | {"byte_size": 64}, (400, "cuda_unavailable"), cuda | {"byte_size": 0}
        ),
    }  # fmt: skip
    with http_client(worker.tcp_url, timeout=30) as h:
        for route, (body, answer, bad_field) in routes.items():
            r = h.post(route, content=json.dumps(body), headers=headers)
            assert (r.status_code, r.json().get("code")) == answer, (route, r.text)
            # What is not a valid body gets the route's usual refusal, whatever the header.
            bad = {b"{not json": "bad_request", b"[]": "bad_request",
                   json.dumps(bad_field).encode(): "bad_byte_size"}  # fmt: skip
            for content, code in bad.items():
                r = h.post(route, content=content, headers=headers)
                assert (r.status_code, r.json()["code"]) == (400, code), (route, content, r.text)
                assert r.json()["error"] and r.json()["detail"]
        assert [r["name"] for r in h.get("/v2/systemsharedmemory/status").json()] == ["ct"]
        assert h.post("/v2/systemsharedmemory/region/ct/unregister", headers=headers).json() == {}
