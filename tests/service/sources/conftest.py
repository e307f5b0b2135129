"""The fixtures the CUDA tests share: a stand-in for the CUDA calls a client makes, and a
real worker that has no GPU."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import torch

from tests.support.worker import Worker, Workers

GPU_UUID = str(uuid.UUID(int=0x1234))


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Stands in for the CUDA calls the client makes; records them in order."""
    calls: list[str] = []

    class Stream:
        def synchronize(self) -> None:
            calls.append("synchronize")

    class Props:
        uuid = uuid.UUID(GPU_UUID)

    class Event:
        def __init__(self, interprocess: bool = False):
            assert interprocess, "the worker opens it from another process"

        def record(self, stream: object) -> None:
            calls.append("record")

        def ipc_handle(self) -> bytes:
            return b"\x07" * 64

    stream = Stream()
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: Noop())
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    monkeypatch.setattr(
        torch.UntypedStorage,
        "_release_ipc_counter_cuda",
        lambda handle, offset: calls.append(f"release {handle.decode()} {offset}"),
    )
    return calls


class Noop:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.fixture(scope="module")
def cpu_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    started = Workers(lambda: tmp_path_factory.mktemp("cpu-worker"))
    # Hidden where there is a GPU (a worker started afresh); where there is none, the
    # worker forked from the zygote already sees none.
    hidden = {"CUDA_VISIBLE_DEVICES": ""} if torch.cuda.is_available() else {}
    yield started.start(env=os.environ | hidden)
    started.stop_all()


@pytest.fixture(scope="module")
def gpu_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A worker on this host's GPUs (the tests that use it need one: ``cuda``)."""
    started = Workers(lambda: tmp_path_factory.mktemp("gpu-worker"))
    yield started.start()
    started.stop_all()
