"""Outputs to memory (``memory://name.mp4``): encoded and validated as files are, held in a
sealed memfd, taken once over the fd socket; the bytes are the file's, nothing stays."""

from __future__ import annotations

import fcntl
import hashlib
import os
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from framewire.client import BadRequest, Client, FramewireError, NotFound
from framewire.core import fdsocket
from framewire.core.fdsocket import take_hashed, take_output

from tests.support.media import make_clip
from tests.support.processes import is_spool, spools


def test_a_memory_output_is_the_files_bytes_taken_once(worker, tmp_path):
    clip = make_clip(frames=6, height=48, width=64, seed=5)
    with Client(worker.uds_url, fd_socket=worker.fd_socket) as fw:
        on_disk = fw.save_video(clip, worker.outputs / "a.mp4", fps=24)
        [held] = fw.save_videos([clip], ["memory://a.mp4"], fps=24)
        assert held.path == held.url == "memory://a.mp4" and held.handoff is not None
        assert held.data is not None and hashlib.sha256(held.data).hexdigest() == held.sha256
        assert held.sha256 == on_disk.sha256 and held.bytes == len(held.data)
        assert "data" not in held.model_dump()  # never on the wire
        with pytest.raises(NotFound) as again:
            take_output(held.handoff, worker.fd_socket, 10)  # once per ticket
        assert again.value.code == "handoff_not_found"
        with fw.open_video("memory://b.mp4", fps=24) as writer:
            for t0 in range(0, 6, 2):
                writer.write(clip[:, t0 : t0 + 2])
        assert writer.result is not None and writer.result.data is not None
        assert hashlib.sha256(writer.result.data).hexdigest() == on_disk.sha256
        for bad in ("memory://a.gif", "memory://../a.mp4", "memory://"):
            with pytest.raises(BadRequest) as refused:
                fw.save_video(np.zeros((2, 16, 16, 3), np.uint8), bad, fps=24)
            assert refused.value.code == "bad_url"
    assert all(list(spool.iterdir()) == [] for spool in spools(worker.outputs))
    assert sorted(p.name for p in worker.outputs.iterdir() if not is_spool(p)) == ["a.mp4"]


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def test_taking_an_output_holds_one_copy_of_it(worker, segments):
    """The held memfd is read into the bytes, not mapped: a mapping's pages count in the
    taker's memory beside the bytes while they are copied (two copies at the peak)."""
    noise = torch.rand(3, 12, 480, 832, generator=torch.Generator().manual_seed(1))
    output = {"source": segments.source(noise), "path": "memory://n.mp4", "fps": 24, "quality": 10}
    body = {"outputs": [output]}
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(worker.uds)), timeout=60) as http:
        answer = http.post("http://framewire/v1/videos:encode", json=body).json()
    [held] = answer["outputs"]
    assert held["bytes"] > 4 << 20, "too small an output to tell one copy from two"
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # VmHWM from here
    before = _status_bytes("VmRSS")
    data = take_output(held["handoff"], worker.fd_socket, 10, sha256=held["sha256"])
    grew = _status_bytes("VmHWM") - before
    assert hashlib.sha256(data).hexdigest() == held["sha256"]
    assert grew < 1.25 * len(data), f"{grew} bytes at the peak for {len(data)} taken"


def _memfd(data: bytes, seals: int) -> int:
    fd = os.memfd_create("held", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_taken_bytes_are_hashed_while_they_are_read(monkeypatch):
    """The sealed memfd is hashed on a second thread beside the copy into the bytes (for
    the check against the worker's sha256: take_output's, below); a memfd that could still
    change is refused."""
    data = np.random.default_rng(3).integers(0, 256, fdsocket.HASH_BESIDE, np.uint8).tobytes()
    digest = hashlib.sha256(data).hexdigest()
    sealed = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    hashing: list[list[str]] = []
    whole = fdsocket._read_whole

    def read_whole(fd: int, size: int) -> bytes:
        hashing.append([t.name for t in threading.enumerate()])
        return whole(fd, size)

    monkeypatch.setattr(fdsocket, "_read_whole", read_whole)
    fd = _memfd(data, sealed)
    try:
        assert fdsocket._read_hashed(fd, len(data)) == (data, digest)
        assert "framewire-take-sha256" in hashing[0]  # beside the copy, not after it
    finally:
        os.close(fd)
    for seals in (0, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW, fcntl.F_SEAL_WRITE):
        fd = _memfd(data, seals)
        try:
            with pytest.raises(FramewireError) as open_to_change:
                fdsocket._read_hashed(fd, len(data))
            assert open_to_change.value.code == "protocol"
        finally:
            os.close(fd)
    assert not [t for t in threading.enumerate() if t.name == "framewire-take-sha256"]
    small = data[:4096]  # hashed once read: no thread
    fd = _memfd(small, sealed)
    try:
        assert fdsocket._read_hashed(fd, len(small)) == (small, hashlib.sha256(small).hexdigest())
        assert "framewire-take-sha256" not in hashing[-1]
    finally:
        os.close(fd)


def test_a_held_output_taken_with_another_sha256_raises(worker, segments):
    clip = make_clip(frames=4, height=48, width=64, seed=6)
    output = {"source": segments.source(clip), "path": "memory://m.mp4", "fps": 24}
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(worker.uds)), timeout=60) as http:
        answer = http.post("http://framewire/v1/videos:encode", json={"outputs": [output]}).json()
    [held] = answer["outputs"]
    with pytest.raises(FramewireError) as other:
        take_output(held["handoff"], worker.fd_socket, 10, sha256="0" * 64)
    assert other.value.code == "output_mismatch"


def test_a_sessions_chunk_buffers_are_let_go_before_its_output_is_taken(worker, monkeypatch):
    """Every chunk answered, the worker reads none of them again: the buffers (a chunk's
    frames each) are not held beside the output's bytes."""
    from framewire.client import _session

    mapped_at_take: list[int] = []

    def take(*args, **kw):
        maps = Path("/proc/self/maps").read_text()
        mapped_at_take.append(maps.count("memfd:framewire-frames"))
        return take_hashed(*args, **kw)

    monkeypatch.setattr(_session, "take_hashed", take)  # as soon as the file is whole
    clip = make_clip(frames=6, height=48, width=64, seed=5)
    with (
        Client(worker.uds_url, fd_socket=worker.fd_socket) as fw,
        fw.open_video("memory://b.mp4", fps=24) as writer,
    ):
        for t0 in range(0, 6, 2):
            writer.write(clip[:, t0 : t0 + 2])
            assert "memfd:framewire-frames" in Path("/proc/self/maps").read_text()
    assert writer.result is not None and writer.result.data is not None
    assert mapped_at_take == [0]


def test_memory_outputs_need_no_writable_output_root(workers):
    """A memory output is written into its memfd, never into the spool: a worker whose
    output root is gone (or read-only) still takes vLLM-omni's saves, whole or streamed,
    while a file output there is refused as before."""
    w = workers.start()
    w.outputs.rmdir()  # the worker made no spool yet: the root is empty
    clip = make_clip(frames=4, height=48, width=64, seed=7)
    with Client(w.uds_url, fd_socket=w.fd_socket) as fw:
        [held] = fw.save_videos([clip], ["memory://a.mp4"], fps=24)
        with fw.open_video("memory://b.mp4", fps=24) as writer:
            writer.write(clip)
        with pytest.raises(FramewireError) as no_root:
            fw.save_video(clip, "a.mp4", fps=24)
    assert no_root.value.code == "output_root_missing"
    assert writer.result is not None and writer.result.data is not None
    assert held.data is not None and hashlib.sha256(writer.result.data).hexdigest() == held.sha256
    assert not w.outputs.exists()


def test_a_default_output_root_that_cannot_be_made_leaves_the_worker_serving(workers, tmp_path):
    """A worker started where its default output root cannot be made (a read-only working
    directory; here a file of that name) says so and serves: memory outputs, which need
    no root, are taken; a file output there is refused."""
    root = tmp_path / "w"
    root.mkdir()
    (root / "outputs").write_bytes(b"")
    w = workers.start(root=root, default_roots=True)
    assert f"cannot make {root / 'outputs'} (File exists)" in w.log.read_text()
    clip = make_clip(frames=4, height=48, width=64, seed=8)
    with Client(w.uds_url, fd_socket=w.fd_socket) as fw:
        [held] = fw.save_videos([clip], ["memory://a.mp4"], fps=24)
        with pytest.raises(FramewireError) as no_root:
            fw.save_video(clip, "a.mp4", fps=24)
    assert held.data is not None and hashlib.sha256(held.data).hexdigest() == held.sha256
    assert (no_root.value.status, no_root.value.code) == (503, "output_root_missing")
    assert (root / "outputs").read_bytes() == b"" and (root / "inputs").is_dir()
