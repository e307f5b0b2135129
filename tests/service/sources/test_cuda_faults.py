"""CUDA errors get stable codes; one allocation's handle is opened and let go of one step
at a time; a sticky one (the context is poisoned for good) marks its
GPU unusable: later CUDA work for it is refused before anything touches it, /healthz and
Triton's liveness answer 503 so that a supervisor restarts the worker, and a writer's
cleanup still runs when the wait for its stream fails. CUDA's errors are raised here as
torch raises them (their messages); what only a GPU shows is in scripts/gpu-check."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from framewire.core.errors import Conflict, FramewireError, Overloaded, Unavailable
from framewire.core.wire import CudaIpcSource, Layout
from framewire.service._convert.staging import Staging
from framewire.service._http import health, triton
from framewire.service._sources import cuda_convert
from framewire.service._sources.cuda_faults import HEALTH, classified
from framewire.service._sources.cuda_handles import HandleLocks
from framewire.service._sources.cuda_ipc import CudaRuntime

from tests.service.sources.conftest import GPU_UUID
from tests.service.sources.test_cuda import CpuStandIn, descriptor

ILLEGAL = (
    "CUDA error: an illegal memory access was encountered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call"
)


@pytest.fixture(autouse=True)
def fresh_health() -> Iterator[None]:
    HEALTH.clear()
    yield
    HEALTH.clear()


def test_a_sticky_error_marks_its_gpu_and_later_work_on_it_is_refused():
    with pytest.raises(FramewireError) as failed, classified(1):
        raise RuntimeError(ILLEGAL)
    assert (failed.value.status, failed.value.code) == (500, "cuda_error")
    assert "illegal memory access" in failed.value.message
    assert list(HEALTH.lost()) == [1]
    ran = []
    with pytest.raises(Unavailable) as refused, classified(1):
        ran.append(1)  # never: refused before the block
    assert (refused.value.status, refused.value.code) == (503, "cuda_device_unusable")
    assert ran == []
    with classified(0):  # another GPU is untouched
        ran.append(0)
    assert ran == [0]


def test_errors_that_leave_the_context_usable_mark_nothing():
    with pytest.raises(Overloaded) as oom, classified(0):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert oom.value.code == "gpu_out_of_memory"
    with pytest.raises(FramewireError) as other, classified(0):
        raise RuntimeError("CUDA error: invalid argument")
    assert other.value.code == "cuda_error"
    with pytest.raises(ValueError, match="not CUDA"), classified(0):
        raise ValueError("not CUDA: passes through as it is")
    assert HEALTH.lost() == {}


def test_a_writers_cleanup_runs_when_the_wait_for_its_stream_fails():
    """The wait for the writer's stream fails (a sticky error): its GPU buffers go all the
    same; the staging it used unpins and unmaps as it closes, even when unpinning fails."""

    class Poisoned:
        def synchronize(self) -> None:
            raise RuntimeError(ILLEGAL)

    writer = cuda_convert.CudaWriter(CpuStandIn(torch.zeros(3, 2, 4, 4), Layout.CTHW))
    writer.stream = Poisoned()  # type: ignore[assignment]
    writer.scaled = torch.zeros(4)
    with pytest.raises(FramewireError) as failed:
        writer.close()
    assert failed.value.code == "cuda_error"
    assert writer.scaled is None and writer.stream is None
    writer.close()  # again: nothing left to do

    staging = Staging(4096)
    undone: list[str] = []

    def unpin() -> None:
        undone.append("unpin")
        raise RuntimeError(ILLEGAL)

    staging.before_close(unpin)
    with pytest.raises(RuntimeError):
        staging.close()
    assert undone == ["unpin"] and staging.fd == -1  # unmapped and closed all the same


def test_health_and_liveness_say_a_gpu_is_unusable():
    app = FastAPI()
    app.include_router(health.router)
    app.include_router(triton.router)
    with TestClient(app) as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        assert http.get("/v2/health/live").status_code == 200
        with pytest.raises(FramewireError), classified(0):
            raise RuntimeError(ILLEGAL)
        r = http.get("/healthz")
        assert r.status_code == 503
        assert r.json()["status"] == "cuda_device_unusable"
        assert "illegal memory access" in r.json()["devices"]["cuda:0"]
        assert http.get("/v2/health/live").status_code == 503


def test_a_handle_for_an_unusable_gpu_is_not_opened(monkeypatch):
    """Refused by UUID before torch is asked to map anything on that GPU."""
    runtime = CudaRuntime({GPU_UUID: 0})
    opened: list[object] = []
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", lambda *a: opened.append(a))
    with pytest.raises(FramewireError), classified(0):
        raise RuntimeError(ILLEGAL)
    with pytest.raises(Unavailable) as refused:
        runtime.open_ipc(
            CudaIpcSource.model_validate(
                descriptor() | {"event_handle": None, "event_sync_required": False}
            )
        )
    assert refused.value.code == "cuda_device_unusable"
    assert opened == []


def test_opens_and_drops_of_one_handle_run_one_at_a_time():
    """Eight threads open and drop sources over one allocation (SGLang's parallel save:
    views of one batch) and over another: never an open of a handle while a drop of it
    runs, or two of either at once; the other handle is not held back; nothing is left
    counted at the end."""
    locks = HandleLocks()
    busy: dict[bytes, list[str]] = {b"A": [], b"B": []}
    overlaps: list[tuple[bytes, list[str]]] = []
    ran_beside: list[bool] = []

    def step(handle: bytes, what: str) -> None:
        busy[handle].append(what)
        if len(busy[handle]) > 1:
            overlaps.append((handle, list(busy[handle])))
        ran_beside.append(bool(busy[b"A" if handle == b"B" else b"B"]))
        time.sleep(0.002)
        busy[handle].remove(what)

    def rank(handle: bytes) -> None:
        for _ in range(20):
            locks.open(handle, lambda: step(handle, "open"))
            locks.close(handle, lambda: step(handle, "drop"))

    threads = [threading.Thread(target=rank, args=(h,)) for h in [b"A"] * 6 + [b"B"] * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == []
    assert any(ran_beside)  # one handle's steps ran while the other's did
    assert len(locks) == 0


def test_a_failed_open_leaves_its_handle_uncounted():
    locks = HandleLocks()
    with pytest.raises(FramewireError):
        locks.open(b"A", lambda: (_ for _ in ()).throw(FramewireError("no", code="x")))
    assert len(locks) == 0


MEM_HANDLE = bytes(range(64))


def test_a_handle_from_a_newer_torch_is_opened_where_its_bytes_allow_else_refused():
    from framewire.service._sources.cuda_versions import handle_version, importable

    assert [handle_version(v) for v in ("2.3.1", "2.12.0+cu128", "2.13.0", "2.14.1")] == [
        2,
        2,
        2 + 1,
        2 + 1,
    ]
    v3_malloc = b"\x03c" + MEM_HANDLE
    assert importable(v3_malloc, "2.13.0", ours="2.12.0") == b"\x02c" + MEM_HANDLE
    assert importable(v3_malloc, "2.13.0", ours="2.13.0") == v3_malloc
    assert importable(b"\x02c" + MEM_HANDLE, "2.5.1", ours="2.13.0") == b"\x02c" + MEM_HANDLE
    assert importable(MEM_HANDLE, None, ours="2.12.0") == MEM_HANDLE  # CUDA's own
    with pytest.raises(Conflict) as refused:
        importable(b"\x03e" + b"\x00" * 40, "2.13.0", ours="2.12.0")
    assert refused.value.code == "cuda_torch_mismatch"
    assert "2.13.0" in refused.value.message and "2.12.0" in refused.value.message
    with pytest.raises(Conflict):
        importable(b"\x04c" + MEM_HANDLE, "2.99.0", ours="2.13.0")  # unknown: not guessed


def test_the_worker_refuses_a_handle_its_torch_cannot_read_before_any_cuda_call(cpu_worker):
    future = base64.b64encode(b"\x04c" + MEM_HANDLE).decode()
    readable = base64.b64encode(b"\x03c" + MEM_HANDLE).decode()
    out = {"path": "x.mp4", "fps": 24}
    with cpu_worker.http() as h:
        source = descriptor(handle=future, torch_version="2.99.0")
        r = h.post("/v1/videos:encode", json={"outputs": [out | {"source": source}]})
        assert (r.status_code, r.json()["code"]) == (409, "cuda_torch_mismatch"), r.text
        assert "2.99.0" in r.json()["error"]
        source = descriptor(handle=readable, torch_version="2.13.0")
        r = h.post("/v1/videos:encode", json={"outputs": [out | {"source": source}]})
        assert (r.status_code, r.json()["code"]) == (400, "cuda_unavailable")  # the next check


def test_a_cuda_region_names_its_gpu_by_uuid_where_the_indices_differ(monkeypatch):
    """Triton's device_id is the client's index; the worker here sees that GPU as cuda:3
    (another CUDA_VISIBLE_DEVICES): device_uuid, when sent, chooses it."""
    from framewire.service._sources import cuda_ipc

    runtime = CudaRuntime({GPU_UUID: 3})
    opened: list[int] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(cuda_ipc, "open_storage", lambda index, *a: opened.append(index))
    monkeypatch.setattr(runtime, "warm", lambda index: None)  # no context to make here
    runtime.open_region(MEM_HANDLE, 0, 64, device_uuid=GPU_UUID)
    runtime.open_region(MEM_HANDLE, 0, 64)  # no UUID: the client's index, as Triton's
    assert opened == [3, 0]
    with pytest.raises(FramewireError) as unseen:
        runtime.open_region(MEM_HANDLE, 0, 64, device_uuid="9" * 32)
    assert unseen.value.code == "cuda_device_not_found"
