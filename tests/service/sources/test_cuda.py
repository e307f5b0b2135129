"""CUDA tensors: the cuda_ipc wire model, the client's sharing, the worker's GPU route.

Tests marked ``cuda`` need an NVIDIA GPU and skip without one. The others run
anywhere: on the descriptor, on the client with a stand-in for the few CUDA
calls it makes, and on a real worker that has no GPU (CUDA_VISIBLE_DEVICES
hidden), which must refuse CUDA cleanly and keep serving.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from framewire.client import BadRequest, Client, FramewireError
from framewire.client._sharing import share
from framewire.client._sharing.cuda import CudaShare, describe
from framewire.core.wire import (
    CudaIpcSource,
    DType,
    Layout,
    OutputSpec,
    error_code,
    normalize_uuid,
)
from framewire.service._convert.convert import WIRE_DTYPES, slice_frames
from framewire.service._convert.staging import Staging
from framewire.service._encode import encoder as encoder_module
from framewire.service._encode.encoder import EncodeParams, Encoder
from framewire.service._sources import cuda_convert, cuda_ipc
from framewire.service._sources.cuda_convert import CudaTensorSource
from framewire.service._sources.cuda_ipc import CudaRuntime, check_allocation, tensor_on
from framewire.service._sources.frames import Geometry
from framewire.service._stream.output import StreamOutput
from pydantic import ValidationError

from tests.service.sources.conftest import GPU_UUID, Noop
from tests.support import REPO
from tests.support.cuda_producer import clip_for
from tests.support.media import FFMPEG, make_clip, reference_mp4, sha256

HAS_CUDA = torch.cuda.is_available()
gpu_only = pytest.mark.skipif(
    not HAS_CUDA, reason="needs an NVIDIA GPU: torch.cuda.is_available() is False"
)
MIB = 1 << 20


def share_fields(
    nbytes: int, *, offset: int = 0, event: bool = True
) -> tuple[int, bytes, int, int, bytes, int, bytes, bool]:
    """What ``_share_cuda_()`` returns, made up: torch's 66-byte plain-cudaMalloc handle."""
    return (0, b"\x01c" + os.urandom(64), nbytes, offset, b"/torch_1_2_3", 5, os.urandom(64), event)


def descriptor(**over: Any) -> dict[str, Any]:
    clip = make_clip(frames=3)
    src = describe(
        share_fields(clip.numel() * 4),
        dtype=DType.float32,
        shape=tuple(clip.shape),
        stride=tuple(clip.stride()),
        tensor_offset=0,
        layout=Layout.CTHW,
        device_uuid=GPU_UUID,
    )
    return src.model_dump(mode="json", exclude_none=True) | over


def code_of(source: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as err:
        OutputSpec.model_validate({"source": source, "path": "a.mp4", "fps": 24})
    return error_code(err.value.errors())


# ----------------------------------------------------------------------------- the wire


def test_descriptor_round_trips_through_json():
    fields = share_fields(4096, offset=512)
    src = describe(
        fields,
        dtype=DType.float16,
        shape=(2, 3, 8, 16),
        stride=(384, 128, 16, 1),
        tensor_offset=1000,
        layout=Layout.TCHW,
        device_uuid="GPU-" + GPU_UUID.upper(),
    )
    back = OutputSpec.model_validate(
        {"source": json.loads(src.model_dump_json()), "path": "a.mp4", "fps": 24}
    ).source
    assert isinstance(back, CudaIpcSource)
    assert back.handle_bytes == fields[1] and back.event_bytes == fields[6]
    assert base64.b64decode(back.ref_counter_handle or "") == b"/torch_1_2_3"
    assert (back.storage_size_bytes, back.storage_offset_bytes, back.ref_counter_offset) == (
        4096,
        512,
        5,
    )
    assert (back.tensor_offset, back.strides, back.layout) == (1000, [384, 128, 16, 1], "TCHW")
    assert back.device_uuid == GPU_UUID
    assert (back.frames, back.height, back.width) == (2, 8, 16)


def test_uuid_spellings_agree():
    raw = uuid.UUID(GPU_UUID)

    class TorchStyle:  # what get_device_properties(d).uuid offers
        def __init__(self) -> None:
            self.bytes = list(raw.bytes)

    for spelling in (GPU_UUID, GPU_UUID.upper(), f"GPU-{GPU_UUID}", TorchStyle(), raw):
        assert normalize_uuid(spelling) == GPU_UUID
    assert code_of(descriptor(device_uuid="GPU-not-a-uuid")) == "bad_device_uuid"


def test_descriptor_sizes_and_handles_are_checked():
    ok = descriptor()
    size = ok["storage_size_bytes"]
    OutputSpec.model_validate({"source": ok, "path": "a.mp4", "fps": 24})
    assert code_of(ok | {"storage_size_bytes": size - 1}) == "cuda_tensor_out_of_bounds"
    assert code_of(ok | {"tensor_offset": 1}) == "cuda_tensor_out_of_bounds"
    # a stride that walks past the storage, and one that goes backwards
    assert code_of(ok | {"stride": [ok["stride"][0] * 2, *ok["stride"][1:]]}) == (
        "cuda_tensor_out_of_bounds"
    )
    assert code_of(ok | {"stride": [-1, 1, 1, 1]}) == "bad_stride"
    # overlapping (broadcast) strides read inside the storage: allowed
    OutputSpec.model_validate(
        {
            "source": ok | {"stride": [0, 0, 0, 1], "storage_size_bytes": 64 * 4},
            "path": "a",
            "fps": 1,
        }
    )
    assert code_of(ok | {"handle": "not base64!"}) == "bad_cuda_handle"
    assert code_of(ok | {"handle": ""}) == "bad_cuda_handle"
    assert code_of(ok | {"event_handle": None}) == "bad_cuda_handle"  # sync required, no event
    assert code_of(ok | {"event_handle": base64.b64encode(b"x" * 10).decode()}) == (
        "bad_cuda_handle"
    )
    no_event = ok | {"event_sync_required": False}
    del no_event["event_handle"]
    OutputSpec.model_validate({"source": no_event, "path": "a.mp4", "fps": 24})
    assert code_of(ok | {"shape": [3, 3, 48]}) == "bad_shape"
    assert code_of(ok | {"storage_size_bytes": 0}) == "bad_byte_size"


# ----------------------------------------------------------------------------- the client


class FakeStorage:
    def __init__(self, fields: tuple, calls: list[str]):
        self.fields = fields
        self.calls = calls

    def _share_cuda_(self) -> tuple:
        if self.fields is None:  # as torch refuses a storage received over IPC itself
            raise RuntimeError("Attempted to send CUDA tensor received from another process")
        self.calls.append("share")
        return self.fields


class FakeCudaTensor:
    """Looks like a CUDA tensor to the client: the metadata of a real CPU tensor."""

    __module__ = "torch.fake"

    def __init__(
        self, like: torch.Tensor, calls: list[str], fields: tuple | None = None, shared=True
    ):
        self.like = like
        self.calls = calls
        self.fields = fields or (share_fields(like.untyped_storage().nbytes()) if shared else None)
        self.shared = shared
        self.device = torch.device("cuda", 0)
        self.dtype, self.shape, self.layout = like.dtype, like.shape, like.layout

    def __getitem__(self, index: int) -> FakeCudaTensor:
        return FakeCudaTensor(self.like[index], self.calls, self.fields, self.shared)

    def to(self, device: str) -> torch.Tensor:
        assert device == "cpu"
        self.calls.append("to host")
        return self.like.clone()

    def stride(self) -> tuple[int, ...]:
        return self.like.stride()

    def storage_offset(self) -> int:
        return self.like.storage_offset()

    def untyped_storage(self) -> FakeStorage:
        return FakeStorage(self.fields, self.calls)


def test_client_describes_a_cuda_tensor_and_releases_once(fake_cuda):
    batch = torch.stack([make_clip(frames=4, seed=1), make_clip(frames=4, seed=2)])
    video = FakeCudaTensor(batch, fake_cuda)[1]  # a view: its storage offset is one clip
    ctx = share(video)
    assert isinstance(ctx, CudaShare)
    with ctx as src:
        assert isinstance(src, CudaIpcSource)
        # No wait here: the worker waits on an event recorded on the producer's stream.
        assert fake_cuda == ["share", "record"]
        assert (src.event_sync_required, src.event_bytes) == (True, b"\x07" * 64)
        assert src.tensor_offset == batch[1].storage_offset() == batch[1].numel()
        assert src.strides == list(batch[1].stride())
        assert (src.shape, src.layout, src.dtype) == ([3, 4, 48, 64], "CTHW", "float32")
        assert src.device_uuid == GPU_UUID
        assert src.storage_size_bytes == batch.numel() * 4
    assert fake_cuda[2:] == ["release /torch_1_2_3 5"]
    ctx.release()
    assert fake_cuda.count("release /torch_1_2_3 5") == 1


def test_client_releases_when_describing_fails(fake_cuda, monkeypatch):
    class BadProps:
        uuid = "no uuid at all"

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: BadProps())
    with pytest.raises(ValueError), share(FakeCudaTensor(make_clip(frames=2), fake_cuda)):
        pass
    assert fake_cuda == ["share", "record", "release /torch_1_2_3 5"]


def test_client_refuses_before_sharing_what_it_cannot_describe(fake_cuda):
    with pytest.raises(ValueError):
        share(FakeCudaTensor(torch.zeros(2, 5, 4, 4), fake_cuda))  # no 3-channel axis
    with pytest.raises(ValueError):
        share(FakeCudaTensor(torch.zeros(3, 2, 4, 4, dtype=torch.int32), fake_cuda))
    assert fake_cuda == []


def test_host_tensors_still_go_through_shared_memory():
    with share(make_clip(frames=2)) as src:
        assert src.kind == "shm"


# ------------------------------------------------------------------------ the worker's GPU code


class CpuStandIn(CudaTensorSource):
    """A CudaTensorSource over a CPU tensor: the GPU route's logic, minus the GPU."""

    def __init__(self, tensor: torch.Tensor, layout: Layout):
        _, frames, height, width = layout.dims(tuple(tensor.shape))
        self.tensor, self.device, self.event = tensor, tensor.device, None
        self.geometry = Geometry(WIRE_DTYPES[tensor.dtype], layout, frames, height, width)
        self.as_is = (
            tensor.dtype == torch.uint8 and layout is Layout.THWC and tensor.is_contiguous()
        )


@pytest.fixture
def no_cuda_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Device switches, streams and page-locking as no-ops (page-locking "succeeds")."""
    calls: list[str] = []

    class Stream:
        def __init__(self, device: object = None):
            calls.append("stream")

        def synchronize(self) -> None:
            calls.append("synchronize")

    monkeypatch.setattr(torch.cuda, "device", lambda device: Noop())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: Noop())
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(cuda_convert, "pin_host", lambda *a: calls.append("pin") or True)
    monkeypatch.setattr(cuda_convert, "unpin_host", lambda *a: calls.append("unpin"))
    return calls


@pytest.mark.parametrize("case", ["float32", "float16", "uint8", "uint8-planar", "strided"])
@pytest.mark.parametrize("route", ["stream", "fallback"])
def test_gpu_writer_logic_is_byte_exact(tmp_path, no_cuda_calls, monkeypatch, case, route):
    """The GPU converter's slicing, scaling, interleave and pinned-slot handling, run on
    CPU tensors through the real pump and ffmpeg: the bytes of the reference."""
    if route == "fallback":
        monkeypatch.setattr(encoder_module.Pump, "send", _broken_pump)
    spec = clip_spec(case, frames=9) | ({"view": "batch"} if case == "float32" else {})
    clip, layout = clip_for(spec)
    source = CpuStandIn(clip, layout)
    encoder = Encoder(FFMPEG, chunk_bytes=1 << 16)  # several frames a chunk, several chunks
    result = encoder.encode(source, tmp_path / "out.mp4", EncodeParams(fps=24))
    assert result.route == route
    assert result.sha256 == reference(spec, tmp_path / "ref.mp4")
    if route == "stream":
        assert no_cuda_calls[:2] == ["stream", "pin"] and no_cuda_calls[-2:] == [
            "synchronize",
            "unpin",
        ]
    per_chunk = encoder.frames_per_chunk(source.geometry)
    g = source.geometry
    expected = 0 if source.as_is else 3 * g.height * g.width * per_chunk
    if g.dtype is not DType.uint8:
        expected *= g.dtype.itemsize + 1
    assert encoder.gpu_bytes(source) == expected


@pytest.mark.parametrize("case", ["float32", "uint8", "strided"])
def test_gpu_writer_logic_across_stream_chunks(tmp_path, no_cuda_calls, case):
    """A stream session's chunks through the GPU converter (CPU stand-ins), the staging
    page-locked once for all of them and unlocked as it closes: the bytes of the
    reference, wherever the chunks fall on the pump's pieces and slots."""
    spec = clip_spec(case, frames=11)
    clip, layout = clip_for(spec)
    chunks = [slice_frames(clip, layout, t0, t1) for t0, t1 in [(0, 1), (1, 7), (7, 11)]]
    result = streamed(tmp_path, [CpuStandIn(c, layout) for c in chunks])
    assert result.sha256 == reference(spec, tmp_path / "ref.mp4") == sha256(tmp_path / "s.mp4")
    assert no_cuda_calls.count("pin") == 1 == no_cuda_calls.count("unpin")


def streamed(tmp_path: Path, sources: list[Any]) -> Any:
    """A stream session's output (the pump's small chunks) fed ``sources`` in turn, then
    finished at ``tmp_path / "s.mp4"``: its result."""
    g = sources[0].geometry
    encoder = Encoder(FFMPEG, chunk_bytes=1 << 16)
    directory = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        session = Geometry(g.dtype, g.layout, 0, g.height, g.width)
        out = StreamOutput(encoder, tmp_path / "s.mp4", EncodeParams(fps=24), session, directory)
        for source in sources:
            out.feed(source, lambda: None)
        return out.finish(lambda: None)
    finally:
        os.close(directory)


def _broken_pump(*args: object, **kw: object) -> int:
    raise OSError("sendfile failed")


def test_allocation_check_refuses_storage_past_the_allocation(monkeypatch):
    storage = torch.UntypedStorage(4096)
    start = storage.data_ptr()
    plain, expandable = b"\x01c" + bytes(64), b"\x01e" + bytes(200)
    monkeypatch.setattr(cuda_ipc, "_allocation_of", lambda ptr: (start - 512, 4608))
    check_allocation(storage, plain, 4096)  # ends exactly at the allocation's end
    check_allocation(storage, bytes(64), 4096)  # CUDA's own raw handle
    with pytest.raises(BadRequest) as err:
        check_allocation(storage, plain, 4097)
    assert err.value.code == "cuda_tensor_out_of_bounds"
    check_allocation(storage, expandable, 1 << 30)  # the driver cannot tell: not asked
    monkeypatch.setattr(cuda_ipc, "_allocation_of", lambda ptr: None)
    check_allocation(storage, plain, 1 << 30)  # unknown: let torch's own checks decide


@pytest.mark.parametrize(
    ("handle", "error", "status", "code"),
    [
        (b"\x01e" + bytes(200), "pidfd_getfd: Operation not permitted", 403,
         "cuda_ipc_not_permitted"),
        (b"\x01e" + bytes(200), "pidfd_open: No such process", 400, "cuda_handle_invalid"),
        (b"\x01e" + bytes(200), "CUDA error: invalid argument", 400, "cuda_handle_invalid"),
        (b"\x01c" + bytes(64), "CUDA error: invalid resource handle", 400,
         "cuda_handle_invalid"),
        (bytes(64), "CUDA error: invalid device context", 400, "cuda_handle_invalid"),
    ],
)  # fmt: skip
def test_handles_torch_cannot_open_are_answered_by_cause(monkeypatch, handle, error, status, code):
    def refuse(*args: object) -> None:
        raise RuntimeError(f"{error}\nException raised from getIpcDevPtr at ...")

    monkeypatch.setattr(torch.cuda, "device", lambda device: Noop())
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", refuse)
    with pytest.raises(FramewireError) as err:
        cuda_ipc.open_storage(0, handle, 4096)
    assert (err.value.status, err.value.code) == (status, code)
    assert error in err.value.message and "Exception raised" not in err.value.message
    if code == "cuda_ipc_not_permitted":
        assert "CAP_SYS_PTRACE" in err.value.message
    if "pidfd_open" in error:
        assert "PID namespace" in err.value.message


def test_tensor_views_are_bounds_checked():
    storage = torch.UntypedStorage(3 * 2 * 4 * 4 * 4)
    t = tensor_on(storage, DType.float32, 0, [3, 2, 4, 4], [32, 16, 4, 1])
    assert t.shape == (3, 2, 4, 4)
    with pytest.raises(BadRequest) as err:
        tensor_on(storage, DType.float32, 1, [3, 2, 4, 4], [32, 16, 4, 1])
    assert err.value.code == "cuda_tensor_out_of_bounds"


def test_no_runtime_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert CudaRuntime.start() is None


# ------------------------------------------------------------------------ a worker without CUDA


def test_worker_without_cuda_refuses_cuda_and_keeps_serving(cpu_worker, tmp_path):
    outputs = [{"source": descriptor(), "path": "cuda.mp4", "fps": 24}]
    with cpu_worker.http() as h:
        r = h.post("/v1/videos:encode", json={"outputs": outputs})
        assert (r.status_code, r.json()["code"]) == (400, "cuda_unavailable"), r.text
        assert r.json()["error"]
        r = h.post(
            "/v1/videos:encode",
            json={"outputs": [outputs[0] | {"source": descriptor(tensor_offset=7)}]},
        )
        assert (r.status_code, r.json()["code"]) == (400, "cuda_tensor_out_of_bounds")
        assert h.get("/healthz").status_code == 200
        about = h.get("/v1/info").json()
        assert (about["device"], about["cuda"]) == ("cpu", None)
    assert not (cpu_worker.outputs / "cuda.mp4").exists()
    clip = make_clip(frames=3)
    with Client(cpu_worker.uds_url) as c:
        assert c.save_video(clip, "after.mp4", fps=24).sha256 == reference_mp4(
            clip, tmp_path / "ref.mp4"
        )


def test_client_cuda_tensor_against_worker_without_cuda(cpu_worker, fake_cuda):
    with Client(cpu_worker.uds_url) as c, pytest.raises(BadRequest) as err:
        c.save_video(FakeCudaTensor(make_clip(frames=2), fake_cuda), "fake.mp4", fps=24)
    assert err.value.code == "cuda_unavailable"
    assert fake_cuda == ["share", "record", "release /torch_1_2_3 5"]


def test_cuda_region_endpoints_without_cuda(cpu_worker, tmp_path):
    body = {"raw_handle": {"b64": base64.b64encode(os.urandom(64)).decode()}, "device_id": 0}
    key = f"/framewire-test-{uuid.uuid4().hex[:12]}"
    Path(f"/dev/shm{key}").write_bytes(b"\0" * 4096)
    try:
        with cpu_worker.http() as h:
            r = h.post("/v2/cudasharedmemory/region/gpu/register", json=body | {"byte_size": 64})
            assert (r.status_code, r.json()["code"]) == (400, "cuda_unavailable")
            assert r.json()["error"]
            bad = h.post("/v2/cudasharedmemory/region/gpu/register", json=body)  # no byte_size
            assert bad.status_code == 400 and "error" in bad.json()
            assert h.get("/v2/cudasharedmemory/status").json() == []
            assert h.get("/v2/cudasharedmemory/region/gpu/status").status_code == 404
            assert h.post("/v2/cudasharedmemory/region/gpu/unregister").status_code == 200
            assert h.post("/v2/cudasharedmemory/unregister").status_code == 200
            # One namespace, two views: a system region is no CUDA region.
            sys_body = {"key": key, "offset": 0, "byte_size": 4096}
            assert h.post("/v2/systemsharedmemory/region/host/register", json=sys_body).is_success
            assert h.get("/v2/cudasharedmemory/status").json() == []
            assert h.get("/v2/cudasharedmemory/region/host/status").status_code == 404
            assert h.post("/v2/cudasharedmemory/unregister").status_code == 200
            assert [s["name"] for s in h.get("/v2/systemsharedmemory/status").json()] == ["host"]
            assert h.post("/v2/systemsharedmemory/region/host/unregister").status_code == 200
            assert h.get("/v2/systemsharedmemory/status").json() == []
    finally:
        Path(f"/dev/shm{key}").unlink(missing_ok=True)


# ----------------------------------------------------------------------------- on a GPU


CASES = {
    "float32": {"dtype": "float32", "layout": "CTHW", "height": 75, "width": 100},
    "float16": {"dtype": "float16", "layout": "TCHW", "height": 48, "width": 64},
    "bfloat16": {"dtype": "bfloat16", "layout": "CTHW", "height": 48, "width": 64},
    "uint8": {"dtype": "uint8", "layout": "THWC", "height": 75, "width": 100},
    "uint8-planar": {"dtype": "uint8", "layout": "CTHW", "height": 48, "width": 64},
    "batch-item": {
        "dtype": "float32",
        "layout": "CTHW",
        "height": 48,
        "width": 64,
        "view": "batch",
    },
    "strided": {"dtype": "float16", "height": 48, "width": 64, "view": "strided"},
}


def clip_spec(case: str, frames: int = 7, seed: int = 0) -> dict[str, Any]:
    return {"frames": frames, "seed": seed} | CASES[case]


def reference(spec: dict[str, Any], path: Path) -> str:
    clip, layout = clip_for(spec)
    return reference_mp4(clip, path, layout=layout)


def producer(spec: dict[str, Any], **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.cuda_producer", json.dumps(spec)],
        cwd=REPO,
        env=os.environ | env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 300) -> Any:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.cuda
@gpu_only
def test_saves_from_another_process_are_byte_exact(gpu_worker, tmp_path, case):
    spec = clip_spec(case)
    out = finish(
        producer(
            {"mode": "save", "url": gpu_worker.uds_url, "clips": [spec], "paths": [f"{case}.mp4"]}
        )
    )
    assert isinstance(out, list), out
    [result] = out
    assert result["ok"] and result["route"] == "stream", result
    assert result["sha256"] == sha256(gpu_worker.outputs / f"{case}.mp4")
    assert result["sha256"] == reference(spec, tmp_path / "ref.mp4")


@pytest.mark.parametrize("case", ["float32", "bfloat16", "uint8"])
@pytest.mark.cuda
@gpu_only
def test_streamed_cuda_chunks_are_byte_exact(gpu_worker, tmp_path, case):
    """open_video with CUDA chunks (IPC handles, converted on the GPU), uneven sizes."""
    spec = clip_spec(case, frames=12)
    result = finish(producer({"mode": "stream", "url": gpu_worker.uds_url, "clips": [spec],
                              "paths": [f"stream-{case}.mp4"], "chunks": [1, 6, 5]}))  # fmt: skip
    assert "error" not in result, result
    assert result["route"] == "stream" and result["frames"] == 12
    assert result["sha256"] == reference(spec, tmp_path / "ref.mp4")
    assert result["sha256"] == sha256(gpu_worker.outputs / f"stream-{case}.mp4")


@pytest.mark.cuda
@gpu_only
def test_two_producers_on_one_gpu_at_once(gpu_worker, tmp_path):
    specs = {
        "a": [clip_spec("float32", frames=30, seed=1), clip_spec("float32", frames=12, seed=2)],
        "b": [clip_spec("bfloat16", frames=24, seed=3), clip_spec("bfloat16", frames=9, seed=4)],
    }
    procs = {
        name: producer(
            {
                "mode": "save",
                "url": gpu_worker.uds_url,
                "clips": clips,
                "paths": [f"two/{name}{i}.mp4" for i in range(len(clips))],
            }
        )
        for name, clips in specs.items()
    }
    for name, proc in procs.items():
        results = finish(proc)
        assert isinstance(results, list), results
        for i, (result, spec) in enumerate(zip(results, specs[name], strict=True)):
            assert result["ok"], result
            assert result["sha256"] == reference(spec, tmp_path / f"{name}{i}.mp4")


@pytest.mark.cuda
@gpu_only
def test_bad_handles_are_refused_and_the_worker_keeps_serving(gpu_worker, tmp_path):
    spec = clip_spec("float32", frames=5)
    # Described by a process that then died: the handle names freed memory.
    dead = producer({"mode": "describe", "exit": True, "clips": [spec]})
    freed = finish(dead)
    # Described by a process that holds it: valid, until the claims are inflated.
    live = producer({"mode": "describe", "clips": [spec]})
    assert live.stdout is not None
    held = json.loads(live.stdout.readline())
    real = torch.cuda.get_device_properties(0).uuid
    try:
        cases = [
            (freed, 400, "cuda_handle_invalid"),
            (
                held | {"handle": base64.b64encode(b"\x01c" + os.urandom(64)).decode()},
                400,
                "cuda_handle_invalid",
            ),
            (held | {"device_uuid": str(uuid.uuid4())}, 404, "cuda_device_not_found"),
            (
                held | {"storage_size_bytes": held["storage_size_bytes"] + (1 << 30)},
                400,
                "cuda_tensor_out_of_bounds",
            ),
        ]
        with gpu_worker.http() as h:
            for source, status, code in cases:
                r = h.post(
                    "/v1/videos:encode",
                    json={"outputs": [{"source": source, "path": "bad.mp4", "fps": 24}]},
                )
                assert (r.status_code, r.json().get("code")) == (status, code), r.text
                assert h.get("/healthz").status_code == 200
            assert not (gpu_worker.outputs / "bad.mp4").exists()
            assert normalize_uuid(real) == held["device_uuid"]
            # The live one as it was sent still works after all that.
            r = h.post(
                "/v1/videos:encode",
                json={"outputs": [{"source": held, "path": "held.mp4", "fps": 24}]},
            )
            assert r.status_code == 200, r.text
            assert r.json()["outputs"][0]["sha256"] == reference(spec, tmp_path / "ref.mp4")
    finally:
        live.stdin.close()  # type: ignore[union-attr]
        live.wait(timeout=60)
    assert live.returncode == 0, live.stderr.read()  # type: ignore[union-attr]


@pytest.mark.cuda
@gpu_only
def test_cuda_region_register_encode_status_unregister(gpu_worker, tmp_path):
    spec = clip_spec("float16", frames=6, seed=5)
    out = finish(
        producer(
            {
                "mode": "region",
                "uds": str(gpu_worker.uds),
                "name": "gpu-clip",
                "clips": [spec],
                "paths": ["region.mp4"],
            }
        )
    )
    assert out["register"][0] == 200, out
    assert out["encode"][0] == 200, out
    assert out["encode"][1]["outputs"][0]["sha256"] == reference(spec, tmp_path / "ref.mp4")
    [status] = out["status"]
    assert (status["name"], status["device_id"]) == ("gpu-clip", 0)
    assert out["system_status"] == []
    assert (out["unregister"], out["after"]) == (200, 404)


@pytest.mark.cuda
@gpu_only
def test_worker_reports_its_gpu(gpu_worker):
    with gpu_worker.http() as h:
        about = h.get("/v1/info").json()
    assert about["device"] == "cuda"
    [device] = [d for d in about["cuda"]["devices"] if d["index"] == 0]
    assert device["uuid"] == normalize_uuid(torch.cuda.get_device_properties(0).uuid)
    assert device["max_memory_allocated"] >= 0


@pytest.mark.cuda
@gpu_only
def test_peak_gpu_memory_stays_within_the_chunk_budget(tmp_path):
    """A 240-frame 1344x768 float32 clip: ~3 GB of input, well under 160 MiB on top."""
    gen = torch.Generator("cuda").manual_seed(0)
    clip = torch.rand((3, 240, 768, 1344), generator=gen, device="cuda")
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    source = CudaTensorSource(clip)
    encoder = Encoder(FFMPEG)
    try:
        result = encoder.encode(
            source, tmp_path / "peak.mp4", EncodeParams(fps=24, preset="ultrafast")
        )
    finally:
        source.close()
    peak = torch.cuda.max_memory_allocated() - baseline
    assert result.route == "stream" and result.frames == 240
    assert peak <= 160 * MIB, f"{peak / MIB:.0f} MiB of GPU temporaries"
    assert encoder.gpu_bytes(CudaTensorSource(clip)) <= 160 * MIB


@pytest.mark.cuda
@gpu_only
def test_staging_is_page_locked_and_gpu_memory_budgeted():
    """The memfd staging takes cudaHostRegister (else the copies run unpinned, slower)."""
    device = torch.device("cuda", 0)
    with Staging(8 * MIB, in_flight=1 << 20) as staging:
        address = staging.address()
        assert cuda_convert.pin_host(address, staging.size, device)
        cuda_convert.unpin_host(address, device)
    # a quarter of the device's free memory, plus what is held there
    budget = CudaRuntime().gpu_budget(lambda index: 5 if index == 0 else 0)
    assert budget(0) > 5 + 1 * MIB


@pytest.mark.cuda
@gpu_only
def test_reference_route_converts_on_the_gpu_too(tmp_path, monkeypatch):
    """The fallback (fast path broken) gives the same bytes from a CUDA source."""
    monkeypatch.setattr(encoder_module.Pump, "send", _broken_pump)
    spec = clip_spec("bfloat16", frames=9)
    clip, layout = clip_for(spec, "cuda")
    source = CudaTensorSource(clip, layout)
    try:
        result = Encoder(FFMPEG).encode(source, tmp_path / "fb.mp4", EncodeParams(fps=24))
    finally:
        source.close()
    assert result.route == "fallback"
    assert result.sha256 == reference(spec, tmp_path / "ref.mp4")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_vllm_omni_profile_converts_on_the_gpu_as_on_the_host(no_cuda_calls, dtype):
    """A CUDA source under the vllm-omni profile is converted where it lies (the GPU
    writer with vLLM-omni's scale): the same bytes as the host conversion, NaN,
    infinities and values out of range included (CPU stand-ins for the GPU's tensors)."""
    from framewire.service._encode.profiles import profile_writer, vllm_omni_convert
    from framewire.service._encode.pump import HostWriter
    from framewire.service._sources.frames import TensorSource

    spec = clip_spec("float32", frames=5) | {"dtype": dtype, "specials": True}
    clip, layout = clip_for(spec)
    clip = clip * 3 - 1.5  # well past (-1, 1) both ways, as a VAE's output may be
    g = CpuStandIn(clip, layout).geometry
    writer = profile_writer(CpuStandIn(clip, layout), "vllm-omni", (-1.0, 1.0))
    assert isinstance(writer, cuda_convert.CudaWriter)  # converted where the frames lie
    host = HostWriter(TensorSource(clip, layout), vllm_omni_convert((-1.0, 1.0)))
    outs = [torch.zeros((5, g.height, g.width, 3), dtype=torch.uint8) for _ in range(2)]
    writer.open(None, 5)
    try:
        writer.write(lambda: outs[0], 0, 5)
    finally:
        writer.close()
    host.write(lambda: outs[1], 0, 5)
    assert torch.equal(outs[0], outs[1])
    assert outs[0].max() == 255 and outs[0].min() == 0


def test_the_diffusers_profile_copies_a_cuda_chunk_to_the_host_once(no_cuda_calls):
    """diffusers' conversion runs on the host (numpy's wrap of out-of-range values): a
    CUDA chunk crosses in one copy, not one per cache-sized block, with the host's bytes."""
    from framewire.service._encode.profiles import diffusers_convert, profile_writer
    from framewire.service._encode.pump import HostWriter
    from framewire.service._sources.frames import TensorSource

    clip, layout = clip_for(clip_spec("float32", frames=6) | {"height": 240, "width": 320})
    reads: list[tuple[int, int]] = []

    class Counted(CpuStandIn):
        def read(self, t0, t1, r0=0, r1=None):
            reads.append((t0, t1))
            return super().read(t0, t1, r0, r1)

    g = CpuStandIn(clip, layout).geometry
    writer = profile_writer(Counted(clip, layout), "diffusers")
    host = HostWriter(TensorSource(clip, layout), diffusers_convert)
    outs = [torch.zeros((6, g.height, g.width, 3), dtype=torch.uint8) for _ in range(2)]
    for w, out in zip((writer, host), outs, strict=True):
        assert w is not None
        for t0, t1 in [(0, 4), (4, 6)]:
            w.write(lambda out=out, t0=t0, t1=t1: out[t0:t1], t0, t1)
    assert torch.equal(outs[0], outs[1])
    assert reads == [(0, 4), (4, 6)]  # a read per frame-sized block before: 6


def test_host_chunks_after_a_cuda_chunk_never_punch_the_locked_staging(
    tmp_path, no_cuda_calls, monkeypatch
):
    """A session's first chunk from a GPU page-locks its staging until the session ends;
    host chunks after it must not punch those pages (a GPU's later copies would land in
    pages the mapping no longer has): they wait for the pipe instead, and the file is the
    clip's."""
    from framewire.service._convert import staging as staging_module
    from framewire.service._sources.frames import TensorSource

    punched: list[bool] = []
    real_slot = staging_module.Staging.slot

    def slot(self, index: int, nbytes: int, *, punch: bool = True):
        punched.append(punch and self.locked)
        return real_slot(self, index, nbytes, punch=punch)

    monkeypatch.setattr(staging_module.Staging, "slot", slot)
    spec = clip_spec("float32", frames=12)
    clip, layout = clip_for(spec)
    first = CpuStandIn(slice_frames(clip, layout, 0, 4), layout)  # from a GPU
    host = [TensorSource(slice_frames(clip, layout, a, b), layout) for a, b in [(4, 8), (8, 12)]]
    result = streamed(tmp_path, [first, *host])
    assert no_cuda_calls.count("pin") == 1 == no_cuda_calls.count("unpin")
    assert punched and not any(punched)  # no locked slot was punched
    assert result.sha256 == reference(spec, tmp_path / "ref.mp4")
