"""How the client hands host frames over: the fd handover when it reaches the worker's fd socket,
named segments otherwise, and never the wrong worker's socket."""

from __future__ import annotations

import asyncio
import mmap
import os
import resource
from typing import Any

import numpy as np
import pytest
import torch
from framewire.client import AsyncClient, Client, Unavailable
from framewire.client._handover import Handover
from framewire.client._sharing import fd as fd_module

from tests.support.media import make_clip, reference_mp4, sha256
from tests.support.worker import Worker

WORKER_ARGS = ()


def our_segments() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"framewire-{os.getpid()}-")]


def regions(worker: Worker) -> list[dict[str, Any]]:
    with worker.http() as h:
        return h.get("/v2/systemsharedmemory/status").json()


class Watch:
    """Counts the memfds the client makes, and looks at /dev/shm while a call is in flight."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.memfds = 0
        self.segments_seen: list[str] = []
        real = fd_module.Memfd.__init__

        def init(memfd: Any, nbytes: int) -> None:
            self.memfds += 1
            real(memfd, nbytes)
            self.segments_seen += our_segments()

        monkeypatch.setattr(fd_module.Memfd, "__init__", init)


def test_a_client_of_a_worker_takes_the_fd_route(worker, tmp_path, monkeypatch):
    """No fd socket named: the one /v1/info names, once it proves to be this worker's."""
    watch = Watch(monkeypatch)
    clip = make_clip(frames=5, height=32, width=48)
    with Client(worker.uds_url) as c:
        assert c.host_route == "shm"  # not tried before the first call
        result = c.save_video(clip, "fd.mp4", fps=24)
        assert c.host_route == "fd"
    assert result.sha256 == reference_mp4(clip, tmp_path / "ref.mp4")
    assert sha256(worker.outputs / "fd.mp4") == result.sha256
    assert watch.memfds == 1 and watch.segments_seen == []  # one copy, no /dev/shm name
    assert regions(worker) == [] and our_segments() == []


def test_the_async_client_takes_it_too(worker, tmp_path):
    video = np.random.default_rng(1).integers(0, 256, (4, 32, 48, 3), np.uint8)

    async def go() -> tuple[str, str]:
        async with AsyncClient(worker.uds_url) as c:
            result = await c.save_video(video, "afd.mp4", fps=24)
            return c.host_route, result.sha256 or ""

    route, digest = asyncio.run(go())
    assert route == "fd"
    assert digest == reference_mp4(torch.from_numpy(video), tmp_path / "r.mp4", layout="THWC")
    assert regions(worker) == []


def test_a_torch_shared_tensor_goes_without_a_copy(worker, tmp_path, monkeypatch):
    watch = Watch(monkeypatch)
    clip = make_clip(frames=4, height=32, width=48).share_memory_()
    with Client(worker.uds_url, fd_socket=worker.fd_socket) as c:
        result = c.save_video(clip, "shared.mp4", fps=24)
    assert watch.memfds == 0  # its own descriptor was handed over
    assert result.sha256 == reference_mp4(clip, tmp_path / "ref.mp4")


def test_another_workers_socket_is_not_used(workers, tmp_path):
    """/v1/info of worker A naming B's socket (a shared path, a stale config): A's instance
    does not answer there, so frames go as named segments."""
    a, b = workers.start(), workers.start()
    with a.http() as h:
        info = h.get("/v1/info").json()
    route = Handover(None, 60)
    route.connect(info | {"sockets": {"fd_socket": str(b.fd_socket)}})
    assert route.name == "shm" and route.settled()  # so callers do not try it again
    fresh = Handover(None, 60)
    fresh.connect(info)
    assert fresh.name == "fd"
    fresh.close()


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_a_named_socket_of_another_worker_is_passed_over(
    workers, tmp_path, monkeypatch, caplog, how
):
    """FRAMEWIRE_FD_SOCKET (or fd_socket=) naming worker B's socket while HTTP goes to A (a
    container that inherited another worker's variable): frames registered with B and the
    encode sent to A would fail; the client takes A's own socket instead, and says so."""
    a, b = workers.start(), workers.start()
    if how == "environment":
        monkeypatch.setenv("FRAMEWIRE_FD_SOCKET", str(b.fd_socket))
    clip = make_clip(frames=3, height=16, width=16)
    named = {"fd_socket": b.fd_socket} if how == "argument" else {}
    with caplog.at_level("WARNING", "framewire.client"), Client(a.uds_url, **named) as c:
        result = c.save_video(clip, "mine.mp4", fps=24)
        assert c.host_route == "fd" and c._handover.regions.path == a.fd_socket
        c.save_video(clip, "again.mp4", fps=24)
    assert result.sha256 == reference_mp4(clip, tmp_path / "ref.mp4")
    assert sha256(a.outputs / "mine.mp4") == result.sha256
    passed_over = [r for r in caplog.records if str(b.fd_socket) in r.getMessage()]
    assert len(passed_over) == 1 and "another worker's" in passed_over[0].getMessage()
    assert regions(a) == [] and regions(b) == []


def test_a_named_socket_is_tried_until_a_worker_answers_there(workers, tmp_path):
    root = tmp_path / "later"
    clip = make_clip(frames=3, height=16, width=16)
    with Client(f"unix://{root}/api.sock", fd_socket=root / "fd.sock") as c:
        assert not c._handover.settled()
        with pytest.raises(Unavailable):  # nobody there yet: the call says so
            c._run(c._handover_plan())
        assert c.host_route == "shm" and not c._handover.settled()  # and tries again
        w = workers.start(root=root)
        result = c.save_video(clip, "late.mp4", fps=24)
        assert c.host_route == "fd"
    assert result.sha256 == reference_mp4(clip, tmp_path / "ref.mp4")
    assert regions(w) == []


def test_a_user_the_fd_socket_refuses_uses_named_segments(workers, tmp_path):
    w = workers.start("--allowed-uids", "12345")
    clip = make_clip(frames=3, height=16, width=16)
    with Client(w.uds_url, fd_socket=w.fd_socket) as c:
        result = c.save_video(clip, "refused.mp4", fps=24)
        assert c.host_route == "shm" and c._handover.settled()  # refused once, not asked again
    assert result.sha256 == reference_mp4(clip, tmp_path / "ref.mp4")


@pytest.mark.parametrize(
    "video",
    [
        np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(3, 2, 4, 5) / 120,
        torch.rand(3, 2, 4, 5, dtype=torch.bfloat16).requires_grad_(),
        torch.rand(3, 6, 4, 5)[:, ::2],  # strided: through the mapping
        np.asfortranarray(np.random.default_rng(0).random((3, 2, 4, 5), dtype=np.float32)),
    ],
    ids=["numpy", "torch-bf16-grad", "strided", "fortran"],
)
def test_a_memfd_holds_the_frames_bytes_on_first_and_later_writes(video):
    from framewire.core.frames import describe

    frames = describe(video)
    if isinstance(video, torch.Tensor):
        expected = video.detach().contiguous().view(torch.uint8).numpy().tobytes()
    else:
        expected = np.ascontiguousarray(video).tobytes()
    with fd_module.Memfd(frames.nbytes) as memfd:
        for _ in range(2):  # fresh pages (pwrite when contiguous), then reused (mapping)
            memfd.write(frames)
            assert os.pread(memfd.fd, frames.nbytes, 0) == expected
            os.pwrite(memfd.fd, bytes(frames.nbytes), 0)  # cleared for the next write


def test_a_chunk_buffer_holds_each_chunk_whether_shorter_or_longer_than_before():
    from framewire.core.frames import describe

    rng = np.random.default_rng(1)
    frame_bytes = 3 * 64 * 64
    with fd_module.Memfd(4 * frame_bytes) as memfd:  # made for the longest chunk to come
        for frames in (1, 4, 2, 4, 3):  # longer than any write before, then within
            video = rng.integers(0, 256, (frames, 64, 64, 3), dtype=np.uint8)
            memfd.write(describe(video, "THWC"))
            assert os.pread(memfd.fd, video.nbytes, 0) == video.tobytes()


def test_a_reused_chunk_buffer_is_written_without_a_fault_per_page():
    """The copies after the first go through the mapping, its pages entered at once."""
    from framewire.core.frames import describe

    with mmap.mmap(-1, mmap.PAGESIZE) as scratch:
        try:
            scratch.madvise(fd_module.MADV_POPULATE_READ)
        except OSError:
            pytest.skip("this kernel refuses MADV_POPULATE_READ (Linux 5.14): faults as before")

    video = np.random.default_rng(2).integers(0, 256, (8, 256, 512, 3), dtype=np.uint8)
    frames = describe(video, "THWC")
    pages = video.nbytes // mmap.PAGESIZE  # 768
    with fd_module.Memfd(video.nbytes) as memfd:
        memfd.write(frames)  # fresh: pwrite, nothing mapped here
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        memfd.write(frames)
        memfd.write(frames)
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        assert os.pread(memfd.fd, video.nbytes, 0) == video.tobytes()
    assert faults < pages // 4, f"{faults} faults for {pages} pages"  # faulted page by page: 768+
