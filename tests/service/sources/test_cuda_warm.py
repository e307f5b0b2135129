"""A GPU's CUDA context is made by the first request that names it (or, if told, for
every GPU at start): a visible GPU no rank hands tensors from costs the worker nothing.

torch's CUDA calls are stood in for (no GPU here): what is shown is which GPUs get a
context and when, that two first requests make one, and that a failure to make one is
answered like any CUDA error and tried again. tests/service/sources/test_cuda_device.py
checks on a GPU that the worker holds no GPU memory before its first CUDA request.
"""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch
from framewire.core.errors import FramewireError
from framewire.service._sources import cuda_ipc
from framewire.service._sources.cuda_ipc import CudaRuntime

U0, U1 = "0" * 31 + "a", "1" * 31 + "b"


@pytest.fixture
def contexts(monkeypatch) -> list[int]:
    """The GPUs a context was made on, in order; two stand-in GPUs, cuda:0 and cuda:1."""
    made: list[int] = []

    def make(index: int) -> None:
        time.sleep(0.05)  # long enough for concurrent first requests to meet
        made.append(index)

    def never(*args: object) -> object:
        raise AssertionError("this call makes a context")

    uuids = {0: U0, 1: U1}
    monkeypatch.setattr(cuda_ipc, "_make_context", make)
    monkeypatch.setattr(cuda_ipc, "cuda_available", lambda: True)
    monkeypatch.setattr(cuda_ipc, "open_storage", lambda index, *a: index)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "stand-in")
    monkeypatch.setattr(torch.cuda, "mem_get_info", never)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: types.SimpleNamespace(uuid=uuids[i], name="stand-in", total_memory=1 << 30),
    )
    return made


def test_no_context_until_a_request_names_the_gpu_then_one(contexts):
    runtime = CudaRuntime.start("first-use")
    assert runtime is not None and contexts == []
    assert [d["context"] for d in runtime.info()["devices"]] == [False, False]  # type: ignore[index]
    opened = []
    threads = [
        threading.Thread(target=lambda: opened.append(runtime.open_region(b"h", 0, 64, U1)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert opened == [1] * 4 and contexts == [1]  # four first requests, one context
    runtime.open_region(b"h", 0, 64, U1)
    assert contexts == [1]


def test_start_makes_every_gpus_context(contexts):
    runtime = CudaRuntime.start("start")
    assert runtime is not None and contexts == [0, 1]
    runtime.open_region(b"h", 0, 64, U0)
    assert contexts == [0, 1]


def test_a_gpu_too_full_for_a_context_is_answered_and_tried_again(contexts, monkeypatch):
    runtime = CudaRuntime.start("first-use")
    assert runtime is not None

    def full(index: int) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    monkeypatch.setattr(cuda_ipc, "_make_context", full)
    with pytest.raises(FramewireError) as refused:
        runtime.open_region(b"h", 0, 64, U0)
    assert (refused.value.status, refused.value.code) == (429, "gpu_out_of_memory")
    assert runtime.warmed == set()
    monkeypatch.setattr(cuda_ipc, "_make_context", contexts.append)
    assert runtime.open_region(b"h", 0, 64, U0) == 0 and contexts == [0]


def test_two_gpus_make_their_contexts_side_by_side(contexts, monkeypatch):
    """One GPU's first request does not wait for another GPU's context."""
    runtime = CudaRuntime.start("first-use")
    assert runtime is not None
    both = threading.Barrier(2, timeout=10)  # each context waits for the other's to begin

    def make(index: int) -> None:
        both.wait()
        contexts.append(index)

    monkeypatch.setattr(cuda_ipc, "_make_context", make)
    threads = [
        threading.Thread(target=runtime.open_region, args=(b"h", 0, 64, u)) for u in (U0, U1)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(contexts) == [0, 1]
