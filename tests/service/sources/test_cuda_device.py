"""What only a GPU shows of the CUDA path's fixes (scripts/gpu-check runs these): torch's
expandable segments, a producer whose torch or CUDA_VISIBLE_DEVICES differs from the
worker's, a producer killed mid-encode, a cancel followed at once by overwriting the
tensor, two threads saving views of one allocation, NaN and infinities, half floats over
many chunks, the diffusers and vllm-omni profiles from CUDA, the producer's memory
after each save, and no GPU memory held by a worker before its first CUDA request.
Each producer is a process of its own (tests/support/cuda_producer.py)."""

from __future__ import annotations

import base64
import json
import time

import pytest
import torch

from tests.service.sources.test_cuda import clip_spec, finish, gpu_only, producer, reference
from tests.support.cuda_producer import clip_for
from tests.support.engines import diffusers_save, vllm_omni_quantize, vllm_omni_save
from tests.support.media import sha256
from tests.support.requests import RUNNING, wait_for
from tests.support.worker import Worker

pytestmark = [pytest.mark.cuda, gpu_only]


def saved(w: Worker, spec: dict, path: str, **env: str) -> dict:
    out = finish(producer({"mode": "save", "url": w.uds_url, "clips": [spec],
                           "paths": [path]}, **env))  # fmt: skip
    assert isinstance(out, list), out
    return out[0]


def test_a_producer_with_expandable_segments_is_served_or_told_why(gpu_worker, tmp_path):
    """torch shares expandable segments as descriptors the worker takes with pidfd_getfd:
    byte-exact where the worker may, else 403 cuda_ipc_not_permitted, never a 500."""
    spec = clip_spec("float32", frames=9)
    out = finish(producer({"mode": "save", "url": gpu_worker.uds_url, "clips": [spec],
                           "paths": ["expandable.mp4"]},
                          PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"))  # fmt: skip
    if isinstance(out, dict):
        assert out["error"] == "cuda_ipc_not_permitted", out
    else:
        assert out[0]["sha256"] == reference(spec, tmp_path / "ref.mp4")


def test_a_handle_from_a_newer_torch_is_refused_before_cuda_and_the_next_save_works(
    gpu_worker, tmp_path
):
    spec = clip_spec("float32", frames=5)
    live = producer({"mode": "describe", "clips": [spec]})
    assert live.stdout is not None
    held = json.loads(live.stdout.readline())
    handle = base64.b64decode(held["handle"])
    forged = held | {
        "handle": base64.b64encode(bytes([handle[0] + 1]) + handle[1:]).decode(),
        "torch_version": "9.0.0",
    }
    try:
        with gpu_worker.http() as h:
            body = {"outputs": [{"source": forged, "path": "f.mp4", "fps": 24}]}
            r = h.post("/v1/videos:encode", json=body)
            assert (r.status_code, r.json()["code"]) == (409, "cuda_torch_mismatch"), r.text
            assert h.get("/healthz").status_code == 200
    finally:
        live.communicate(timeout=60)
    assert saved(gpu_worker, spec, "after.mp4")["sha256"] == reference(spec, tmp_path / "r.mp4")


def test_a_producer_naming_its_gpu_by_uuid_is_served(gpu_worker, tmp_path):
    uuid = torch.cuda.get_device_properties(0).uuid
    spec = clip_spec("bfloat16", frames=6)
    got = saved(gpu_worker, spec, "by-uuid.mp4", CUDA_VISIBLE_DEVICES=f"GPU-{uuid}")
    assert got["sha256"] == reference(spec, tmp_path / "ref.mp4")


def test_a_producer_killed_mid_encode_then_a_save_right_after(gpu_worker, tmp_path):
    long = clip_spec("float32", frames=240) | {"height": 480, "width": 640}
    victim = producer({"mode": "save", "url": gpu_worker.uds_url, "clips": [long],
                       "paths": ["killed.mp4"]})  # fmt: skip
    wait_for(gpu_worker, RUNNING, 1, timeout=120)
    victim.kill()
    victim.communicate(timeout=60)
    spec = clip_spec("float16", frames=7)
    assert saved(gpu_worker, spec, "next.mp4")["sha256"] == reference(spec, tmp_path / "r.mp4")
    with gpu_worker.http() as h:
        assert h.get("/healthz").status_code == 200


def test_a_cancel_then_an_overwrite_keeps_no_file_and_the_next_save_is_exact(gpu_worker, tmp_path):
    spec = clip_spec("float32", frames=120) | {"height": 480, "width": 640}
    out = finish(producer({"mode": "cancel_then_overwrite", "url": gpu_worker.uds_url,
                           "clips": [spec], "paths": ["cut.mp4", "again.mp4"],
                           "cancel_s": 0.3}))  # fmt: skip
    assert out["cancelled"], out
    assert out["second"]["sha256"] == reference(spec, tmp_path / "ref.mp4")
    deadline = time.monotonic() + 30
    while (gpu_worker.outputs / "cut.mp4").exists():  # the cancelled encode's file: gone
        assert time.monotonic() < deadline, "the cancelled save left its file"
        time.sleep(0.1)


def test_two_threads_save_views_of_one_allocation_at_once(gpu_worker, tmp_path):
    specs = [clip_spec("float32", frames=12, seed=s) for s in (1, 2)]
    out = finish(producer({"mode": "threads", "url": gpu_worker.uds_url, "clips": specs,
                           "paths": ["t0.mp4", "t1.mp4"]}))  # fmt: skip
    assert [r["sha256"] for r in out] == [
        reference(s, tmp_path / f"r{i}.mp4") for i, s in enumerate(specs)
    ]


@pytest.mark.parametrize("case", ["float32", "float16", "bfloat16"])
def test_nan_infinities_and_out_of_range_values_convert_as_on_the_host(gpu_worker, tmp_path, case):
    spec = clip_spec(case, frames=6) | {"specials": True}
    got = saved(gpu_worker, spec, f"specials-{case}.mp4")
    assert got["sha256"] == reference(spec, tmp_path / "ref.mp4")


@pytest.mark.parametrize("case", ["float16", "bfloat16"])
def test_half_floats_over_many_chunks_are_byte_exact(gpu_worker, tmp_path, case):
    spec = clip_spec(case, frames=40)
    out = finish(producer({"mode": "stream", "url": gpu_worker.uds_url, "clips": [spec],
                           "paths": [f"many-{case}.mp4"], "chunks": [1] * 40}))  # fmt: skip
    assert out["sha256"] == reference(spec, tmp_path / "ref.mp4"), out


def test_the_vllm_omni_profile_from_cuda_has_its_bytes(gpu_worker, tmp_path):
    spec = clip_spec("float32", frames=8) | {"layout": "CTHW"}
    out = finish(producer({"mode": "save", "url": gpu_worker.uds_url, "clips": [spec],
                           "paths": ["omni.mp4"], "profile": "vllm-omni"}))  # fmt: skip
    clip, _ = clip_for(spec)
    want = vllm_omni_save(vllm_omni_quantize(clip, (-1.0, 1.0)), tmp_path / "v.mp4", fps=24)
    assert out[0]["sha256"] == want == sha256(gpu_worker.outputs / "omni.mp4")


def test_the_diffusers_profile_from_cuda_has_its_bytes(gpu_worker, tmp_path):
    spec = clip_spec("float32", frames=8) | {"layout": "CTHW"}
    out = finish(producer({"mode": "save", "url": gpu_worker.uds_url, "clips": [spec],
                           "paths": ["diffusers.mp4"], "profile": "diffusers"}))  # fmt: skip
    clip, _ = clip_for(spec)
    frames = list(clip.permute(1, 2, 3, 0).numpy())  # a pipeline's output_type="np"
    want = diffusers_save(frames, tmp_path / "d.mp4", fps=24)
    assert out[0]["sha256"] == want == sha256(gpu_worker.outputs / "diffusers.mp4")


def test_the_producers_gpu_memory_is_back_after_each_save(gpu_worker):
    for i in range(3):
        spec = clip_spec("float32", frames=16, seed=i)
        out = finish(producer({"mode": "save", "url": gpu_worker.uds_url, "clips": [spec],
                               "paths": [f"mem{i}.mp4"], "memory": True}))  # fmt: skip
        # What the rank sees, with no ipc_collect of its own: the share released.
        assert out["after"] == out["baseline"], out


def gpu_memory_of(pid: int) -> int | None:
    """MiB of GPU memory process ``pid`` holds (nvidia-smi), None if it holds none."""
    import subprocess

    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if fields[0] == str(pid):
            return int(fields[1])
    return None


def test_a_worker_holds_no_gpu_memory_until_its_first_cuda_request(
    workers, tmp_path, record_property
):
    """FRAMEWIRE_CUDA_WARM=first-use (the default): the context, and what it costs, comes
    with the first request naming the GPU; ``start`` makes it at once."""
    lazy = workers.start()
    with lazy.http() as h:
        [device] = h.get("/v1/info").json()["cuda"]["devices"]
    assert device["context"] is False and gpu_memory_of(lazy.pid) is None
    spec = clip_spec("float32", frames=5)
    assert saved(lazy, spec, "first.mp4")["sha256"] == reference(spec, tmp_path / "ref.mp4")
    held = gpu_memory_of(lazy.pid)
    assert held is not None
    eager = workers.start("--cuda-warm", "start")
    at_start = gpu_memory_of(eager.pid)
    # In cuda-tests.xml (scripts/gpu-check): what a worker costs on a GPU.
    record_property("worker_gpu_mib_after_first_request", held)
    record_property("worker_gpu_mib_warmed_at_start", at_start)
    assert at_start is not None
