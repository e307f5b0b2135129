"""Frames handed over as descriptors: ``register``/``unregister`` on the fd socket, spoken by
hand, against a real worker.

What must hold: a registered descriptor is a region like any other (status,
encodes, stream chunks), byte-exact; only memory is taken and its seals are
read from the kernel; a region is its registrant's, goes with its connection
(after the requests using it), and nothing a bad request sends stays open.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from framewire.client.wire import Layout

from tests.support.identity import NOBODY, as_nobody, post_json
from tests.support.media import make_clip, reference_mp4, sha256
from tests.support.refclips import RawConnection
from tests.support.requests import Baseline, Request, encode_body, settle, wait_for_ffmpeg
from tests.support.segments import raw_bytes
from tests.support.worker import Worker

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def memfd(data: bytes, *, sealed: bool = True) -> int:
    fd = os.memfd_create("test-frames", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def register(conn: RawConnection, name: str, fd: int, byte_size: int, **over: Any) -> dict:
    header, fds = conn.call({"op": "register", "name": name, "byte_size": byte_size} | over, [fd])
    assert fds == []
    return header


def region_source(name: str, clip: torch.Tensor, layout: str = "CTHW", offset: int = 0) -> dict:
    dtype = str(clip.dtype).removeprefix("torch.")
    return {"kind": "region", "region": name, "offset": offset, "byte_size": len(raw_bytes(clip)),
            "dtype": dtype, "shape": list(clip.shape), "layout": layout}  # fmt: skip


def encode(worker: Worker, source: dict, path: str) -> tuple[int, dict]:
    with worker.http() as h:
        r = h.post("/v1/videos:encode", json={"outputs": [{"source": source, "path": path,
                                                           "fps": 24}]})  # fmt: skip
    return r.status_code, r.json()


def statuses(worker: Worker) -> list[dict]:
    with worker.http() as h:
        return h.get("/v2/systemsharedmemory/status").json()


@pytest.mark.parametrize(
    ("dtype", "layout", "sealed"),
    [
        (torch.float32, Layout.CTHW, True),  # mapped, converted in place
        (torch.float32, Layout.CTHW, False),  # read with pread
        (torch.bfloat16, Layout.TCHW, True),
        (torch.uint8, Layout.THWC, True),  # sent to ffmpeg from the descriptor itself
    ],
)
def test_a_registered_descriptor_encodes_byte_exact(worker, tmp_path, dtype, layout, sealed):
    clip = make_clip(frames=7, height=50, width=66, dtype=dtype, layout=layout)
    data = raw_bytes(clip)
    fd = memfd(b"\0" * 100 + data, sealed=sealed)  # the frames at an offset
    with RawConnection(worker.fd_socket) as conn:
        header = register(conn, "frames", fd, len(data), offset=100)
        os.close(fd)  # the worker holds its own
        assert header == {"ok": True, "name": "frames", "sealed": sealed}
        assert statuses(worker) == [
            {"name": "frames", "key": "fd:frames", "offset": 100, "byte_size": len(data)}
        ]
        status, body = encode(worker, region_source("frames", clip, layout.value), "r.mp4")
        assert status == 200, body
        expected = reference_mp4(clip, tmp_path / "ref.mp4", layout=layout)
        assert body["outputs"][0]["sha256"] == expected == sha256(worker.outputs / "r.mp4")
        assert conn.call({"op": "unregister", "name": "frames"})[0] == {
            "ok": True,
            "name": "frames",
        }
        assert statuses(worker) == []
    (worker.outputs / "r.mp4").unlink()


def test_a_torch_shared_tensor_is_taken_as_it_is(worker, tmp_path):
    """``share_memory_()`` storage: a /dev/shm file already unlinked, unsealed: read with pread."""
    clip = make_clip(frames=4, height=32, width=48).share_memory_()
    fd, _ = clip.untyped_storage()._share_fd_cpu_()
    with RawConnection(worker.fd_socket) as conn:
        assert register(conn, "torch", fd, len(raw_bytes(clip)))["sealed"] is False
        status, body = encode(worker, region_source("torch", clip), "t.mp4")
    assert status == 200 and body["outputs"][0]["sha256"] == reference_mp4(clip, tmp_path / "r.mp4")
    (worker.outputs / "t.mp4").unlink()


def test_what_is_not_memory_is_refused_and_nothing_stays_open(worker, tmp_path):
    baseline = Baseline.of(worker)
    on_disk = tmp_path / "frames.raw"
    on_disk.write_bytes(b"x" * 4096)
    read_end, write_end = os.pipe()
    left, right = socket.socketpair()
    cases = {
        "a file on disk": os.open(on_disk, os.O_RDONLY),
        "a pipe": read_end,
        "a socket": left.fileno(),
        "a directory": os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY),
        "/dev/zero": os.open("/dev/zero", os.O_RDONLY),
        "write-only memory": os.open(f"/proc/self/fd/{memfd(b'x' * 4096)}", os.O_WRONLY),
    }
    with RawConnection(worker.fd_socket) as conn:
        for what, fd in cases.items():
            header = register(conn, "bad", fd, 16)
            assert (header["ok"], header["code"], header["reason"]) == (
                False, "bad_request", "bad_fd"
            ), (what, header)  # fmt: skip
        small = memfd(b"x" * 100)
        header = register(conn, "small", small, 101)
        assert (header["code"], header["reason"]) == ("bad_request", "region_out_of_bounds")
        header = register(conn, "small", small, 50, offset=60)
        assert header["reason"] == "region_out_of_bounds"
    for fd in [*cases.values(), write_end, small]:
        if fd != left.fileno():
            os.close(fd)
    left.close(), right.close()
    assert statuses(worker) == []
    settle(worker, baseline)  # every descriptor the worker was sent is closed again


def test_descriptor_counts_are_held_to(worker):
    """register takes exactly one; other ops none; too many in one message ends the
    connection. Every one sent is closed by the worker."""
    baseline = Baseline.of(worker)
    a, b = memfd(b"x" * 64), memfd(b"y" * 64)
    with RawConnection(worker.fd_socket) as conn:
        header, _ = conn.call({"op": "register", "name": "n", "byte_size": 8})
        assert header["code"] == "bad_request" and "exactly one descriptor" in header["message"]
        header, _ = conn.call({"op": "register", "name": "n", "byte_size": 8}, [a, b])
        assert header["code"] == "bad_request" and "got 2" in header["message"]
        header, _ = conn.call({"op": "ping"}, [a])
        assert header["code"] == "bad_request" and "no descriptor" in header["message"]
        header, _ = conn.call(b'{"op": "register", "name": "n", "byte_size": 8\n', [a])
        assert header["code"] == "bad_request"  # not JSON: its descriptor closed all the same
        assert conn.call({"op": "ping"})[0]["ok"]  # the connection goes on
    with RawConnection(worker.fd_socket) as conn:
        header, _ = conn.call({"op": "register", "name": "n", "byte_size": 8}, [a] * 5)
        assert header["code"] == "bad_request" and "more than 4" in header["message"]
        with pytest.raises((EOFError, ConnectionError)):
            conn.call({"op": "ping"})  # and the connection is closed
    os.close(a), os.close(b)
    settle(worker, baseline)


def test_names_and_ownership(worker, tmp_path):
    clip = make_clip(frames=2, height=16, width=16)
    data = raw_bytes(clip)
    with RawConnection(worker.fd_socket) as mine, RawConnection(worker.fd_socket) as other:
        fd = memfd(data)
        assert register(mine, "taken", fd, len(data))["ok"]
        assert register(other, "taken", fd, len(data))["reason"] == "region_exists"
        for bad in ("", "-x", "a/b", "x" * 129, "a b"):
            assert register(mine, bad, fd, len(data))["code"] == "bad_request", bad
        os.close(fd)
        # Another connection cannot unregister it; its own can.
        header, _ = other.call({"op": "unregister", "name": "taken"})
        assert (header["code"], header["reason"]) == ("not_found", "region_not_found")
        assert [r["name"] for r in statuses(worker)] == ["taken"]
    assert statuses(worker) == []  # both connections closed: gone


@pytest.mark.parametrize("how", ["unregister", "connection closed"])
def test_a_region_in_use_outlives_its_connection_until_the_encode_ends(worker, tmp_path, how):
    """The rank unregisters its region, or its connection closes (it died), while an encode
    reads it: that returns at once and the region leaves the status; the worker keeps the
    descriptor and its mapping until the encode ends, byte-exact. The encode's ffmpeg is
    held stopped meanwhile, so the encode is surely still running."""
    baseline = Baseline.of(worker)
    # Several times the pipe's capacity of rgb24, and an encode of a good fraction of a
    # second: ffmpeg is surely seen (and stopped) before it is done, on a loaded machine too.
    clip = make_clip(frames=48, height=256, width=256)
    data = raw_bytes(clip)
    conn = RawConnection(worker.fd_socket)
    fd = memfd(data)
    assert register(conn, "dies", fd, len(data))["ok"]
    os.close(fd)
    request = Request(worker, "POST", "/v1/videos:encode",
                      json=encode_body(region_source("dies", clip), "dies.mp4"))  # fmt: skip
    ffmpegs = wait_for_ffmpeg(worker)
    for pid in ffmpegs:
        os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        if how == "unregister":
            assert conn.call({"op": "unregister", "name": "dies"})[0]["ok"]
        conn.close()
        assert time.monotonic() - started < 1.0
        wait_for(lambda: statuses(worker) == [])  # a closing connection is seen soon after
        assert request.is_alive() and held_memfds(worker) == 1  # still the encode's
    finally:
        for pid in ffmpegs:
            os.kill(pid, signal.SIGCONT)
    response = request.result(timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["sha256"] == reference_mp4(clip, tmp_path / "ref.mp4")
    (worker.outputs / "dies.mp4").unlink()
    settle(worker, baseline)  # the region's descriptor and mapping are gone too
    assert held_memfds(worker) == 0


def held_memfds(worker: Worker) -> int:
    """Whether the worker holds this module's memfds: 1 for a descriptor or a mapping."""
    maps = Path(f"/proc/{worker.pid}/maps").read_text()
    fds = any(f.startswith("/memfd:test-frames") for f in worker.open_fds())
    return int(fds or "/memfd:test-frames" in maps)


def wait_for(condition: Callable[[], bool], timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.02)


def test_the_http_routes_never_free_a_connections_region(worker):
    """Only the registering connection frees its region (or its closing does): the /v2
    unregister routes leave it, so its name cannot be taken over meanwhile."""
    data = raw_bytes(make_clip(frames=2, height=16, width=16))
    with RawConnection(worker.fd_socket) as first, RawConnection(worker.fd_socket) as second:
        fd = memfd(data)
        assert register(first, "frames", fd, len(data))["ok"]
        with worker.http() as h:
            assert h.post("/v2/systemsharedmemory/unregister").status_code == 200
            r = h.post("/v2/systemsharedmemory/region/frames/unregister")
            assert (r.status_code, r.json()["code"]) == (403, "caller_not_permitted")
        assert register(second, "frames", fd, len(data))["reason"] == "region_exists"
        os.close(fd)
        assert [r["name"] for r in statuses(worker)] == ["frames"]
        assert first.call({"op": "unregister", "name": "frames"})[0]["ok"]
        assert statuses(worker) == []


def test_an_unsealed_memfd_truncated_mid_encode_is_a_400(worker):
    """Unsealed memory is read, not mapped: shrinking it cannot crash the worker."""
    baseline = Baseline.of(worker)
    clip = make_clip(frames=96, height=256, width=256)
    data = raw_bytes(clip)
    fd = memfd(data, sealed=False)
    with RawConnection(worker.fd_socket) as conn:
        assert register(conn, "shrinks", fd, len(data))["sealed"] is False
        t = threading.Thread(target=lambda: (wait_for_ffmpeg(worker), os.ftruncate(fd, 4096)))
        t.start()
        with worker.http() as h:
            body = {"outputs": [{"source": region_source("shrinks", clip), "path": "s.mp4",
                                 "fps": 24, "preset": "medium"}]}  # fmt: skip
            r = h.post("/v1/videos:encode", json=body)
        t.join()
    os.close(fd)
    assert (r.status_code, r.json()["code"]) == (400, "segment_truncated")
    assert not (worker.outputs / "s.mp4").exists()
    settle(worker, baseline)


def test_a_sealed_memfd_cannot_be_shrunk_under_the_mapping():
    fd = memfd(b"x" * 8192)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 4096)  # the kernel refuses: so the worker may map it
    os.close(fd)


def test_ping_names_the_worker_instance(worker):
    with RawConnection(worker.fd_socket) as conn, worker.http() as h:
        assert conn.call({"op": "ping"})[0]["instance"] == h.get("/v1/info").json()["instance"]


def test_stream_chunks_from_one_registered_memfd(worker, tmp_path):
    """The writer's pattern: one sealed memfd, rewritten for every chunk once answered."""
    clip = make_clip(frames=9, height=48, width=64)
    chunk_bytes = len(raw_bytes(clip[:, :3].contiguous()))
    fd = memfd(b"\0" * chunk_bytes)
    with RawConnection(worker.fd_socket) as conn, worker.http() as h:
        assert register(conn, "staging", fd, chunk_bytes)["sealed"]
        r = h.post("/v1/streams", json={"path": "st.mp4", "fps": 24, "dtype": "float32",
                                        "height": 48, "width": 64})  # fmt: skip
        sid = r.json()["id"]
        for t0 in range(0, 9, 3):
            chunk = clip[:, t0 : t0 + 3].contiguous()
            os.pwrite(fd, raw_bytes(chunk), 0)
            src = region_source("staging", chunk)
            r = h.post(f"/v1/streams/{sid}/frames", json={"first_frame": t0, "source": src})
            assert r.status_code == 200, r.text
        result = h.post(f"/v1/streams/{sid}/finish").json()
    os.close(fd)
    assert result["sha256"] == reference_mp4(clip, tmp_path / "ref.mp4")
    (worker.outputs / "st.mp4").unlink()


def test_peers_not_allowed_are_refused_and_their_descriptors_closed(workers):
    w = workers.start("--allowed-uids", "12345")
    baseline = Baseline.of(w)
    fd = memfd(b"x" * 64)
    with RawConnection(w.fd_socket) as conn:
        assert register(conn, "nope", fd, 64)["code"] == "forbidden"
    os.close(fd)
    assert statuses(w) == []
    settle(w, baseline)


def test_memory_of_another_uid_is_not_read_for_a_caller(worker, tmp_path):
    """An HTTP caller may use a region only if it handed it over (same uid) or is root."""
    clip = make_clip(frames=2, height=16, width=16)
    data = raw_bytes(clip)
    fd = memfd(data)
    try:
        with RawConnection(worker.fd_socket) as conn:
            assert register(conn, "roots", fd, len(data))["ok"]
            body = {"outputs": [{"source": region_source("roots", clip), "path": "n.mp4",
                                 "fps": 24}]}  # fmt: skip
            # Over loopback TCP: the worker knows the caller's uid from the kernel's table.
            got = as_nobody(post_json, worker.tcp_url, "/v1/videos:encode", body)
    finally:
        os.close(fd)
    assert got == (403, "caller_not_permitted"), (NOBODY, got)
    assert not Path(worker.outputs / "n.mp4").exists()
