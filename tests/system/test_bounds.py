"""Nothing waits without a bound, nothing grows without a cap, nothing is left behind.

Each test makes one kind of wait or pile-up happen for real against a worker
with short limits (stall 1.5 s, idle 1 s, 16 connections): a FIFO where a
segment should be, an ffmpeg stopped with SIGSTOP, connections that send
nothing or dribble, a region unregistered while in use, a second worker on the
same sockets, descriptors run out, an output root removed, two writers of one file.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import shutil
import signal
import socket
import stat
import time
from pathlib import Path

import httpx
import pytest
import torch
from framewire.client.wire import Layout

from tests.support.cli import run_cli
from tests.support.http import http_client
from tests.support.media import make_clip, reference_mp4, sha256
from tests.support.processes import wait_gone, wait_until_writes_stop
from tests.support.refclips import RawConnection, make_video
from tests.support.requests import (
    Baseline,
    Request,
    encode_body,
    post_raw,
    settle,
    still_serving,
    wait_for_ffmpeg,
)
from tests.support.segments import raw_bytes, shm_source
from tests.support.worker import Worker

STALL_S, IDLE_S, CONNECTIONS = 1.5, 1.0, 16
LIMITS = (
    "--stall-timeout-s", str(STALL_S), "--idle-timeout-s", str(IDLE_S),
    "--max-connections", str(CONNECTIONS), "--cpu-slots", "1",
)  # fmt: skip


WORKER_ARGS = LIMITS  # the module's worker (tests/conftest.py)


def healthz(worker: Worker, timeout: float = 5) -> int:
    with http_client(worker.tcp_url, timeout=timeout) as h:
        return h.get("/healthz").status_code


# --- FIFOs where files should be ------------------------------------------------------------


def test_a_fifo_named_like_a_segment_blocks_nothing(worker):
    key = f"/framewire-test-fifo-{secrets.token_hex(4)}"
    os.mkfifo(f"/dev/shm{key}")
    try:
        src = {"kind": "shm", "key": key, "offset": 0, "byte_size": 3 * 2 * 16 * 16,
               "dtype": "uint8", "shape": [3, 2, 16, 16]}  # fmt: skip
        reg = {"key": key, "offset": 0, "byte_size": 64}
        started = time.monotonic()
        with http_client(worker.tcp_url, timeout=5) as h:
            r = h.post("/v1/videos:encode", json=encode_body(src, "fifo.mp4"))
            assert (r.status_code, r.json()["code"]) == (400, "bad_shm_key"), r.text
            # More registrations than the worker has pool threads: none may stay blocked.
            for i in range(48):
                r = h.post(f"/v2/systemsharedmemory/region/fifo{i}/register", json=reg)
                assert (r.status_code, r.json()["code"]) == (400, "bad_shm_key"), r.text
            assert h.get("/healthz").status_code == 200
        assert time.monotonic() - started < 10
    finally:
        os.unlink(f"/dev/shm{key}")


# --- ffmpeg that stops making progress -----------------------------------------------------


def long_clip(segments):
    clip = make_clip(frames=96, height=128, width=128)
    return clip, segments.source(clip)


def test_a_stopped_ffmpeg_is_killed_and_answered_504(worker, segments, tmp_path):
    baseline = Baseline.of(worker)
    _, src = long_clip(segments)
    request = Request(worker, "POST", "/v1/videos:encode",
                      json=encode_body(src, "stalled.mp4", preset="veryslow"))  # fmt: skip
    [ffmpeg] = wait_for_ffmpeg(worker)
    os.kill(ffmpeg, signal.SIGSTOP)
    stopped_at = time.monotonic()
    response = request.result(timeout=30)
    waited = time.monotonic() - stopped_at
    assert (response.status_code, response.json()["code"]) == (504, "ffmpeg_stalled")
    assert STALL_S <= waited < STALL_S + 5, waited
    wait_gone({ffmpeg})
    assert not (worker.outputs / "stalled.mp4").exists()
    settle(worker, baseline, keep=set(segments.keys))
    # Its CPU slot came back: with one slot, the next encode would wait forever otherwise.
    still_serving(worker, segments, tmp_path)


def test_a_stopped_ffmpeg_reading_a_producers_pages_is_killed_and_answered_504(
    worker, segments, tmp_path
):
    """A paced session's rgb24 chunk waits until ffmpeg has read it from the producer's
    segment: a stopped ffmpeg ends that wait at the stall bound, as it ends a send."""
    baseline = Baseline.of(worker)
    clip = make_clip(frames=12, height=128, width=128, dtype=torch.uint8, layout=Layout.THWC)
    with http_client(worker.tcp_url, timeout=30) as h:
        body = {"path": "paced-stalled.mp4", "fps": 24, "dtype": "uint8", "layout": "THWC"}
        body |= {"height": 128, "width": 128, "ahead": False}
        opened = h.post("/v1/streams", json=body)
        assert opened.status_code == 201, opened.text
        sid = opened.json()["id"]
        first = {"first_frame": 0, "source": segments.source(clip[:1].contiguous(), "THWC")}
        assert h.post(f"/v1/streams/{sid}/frames", json=first).status_code == 200
        [ffmpeg] = wait_for_ffmpeg(worker)
        os.kill(ffmpeg, signal.SIGSTOP)
        stopped_at = time.monotonic()
        rest = {"first_frame": 1, "source": segments.source(clip[1:].contiguous(), "THWC")}
        r = h.post(f"/v1/streams/{sid}/frames", json=rest)  # 528 KiB: the pipe holds it
        waited = time.monotonic() - stopped_at
        assert (r.status_code, r.json()["code"]) == (504, "ffmpeg_stalled"), r.text
        assert STALL_S <= waited < STALL_S + 5, waited
        assert h.get(f"/v1/streams/{sid}").json()["state"] == "failed"
    wait_gone({ffmpeg})
    assert not (worker.outputs / "paced-stalled.mp4").exists()
    settle(worker, baseline, keep=set(segments.keys))
    still_serving(worker, segments, tmp_path)


def test_a_cancel_reaches_a_pump_blocked_on_a_stopped_ffmpeg(workers, segments):
    w = workers.start("--stall-timeout-s", "120")  # only the disconnect can stop it
    baseline = Baseline.of(w)
    _, src = long_clip(segments)
    with post_raw(w.uds, encode_body(src, "cancelled.mp4", preset="veryslow")):
        [ffmpeg] = wait_for_ffmpeg(w)
        os.kill(ffmpeg, signal.SIGSTOP)
        wait_until_writes_stop(w.pid)  # the pump is blocked on the full pipe
    gone_at = time.monotonic()
    wait_gone({ffmpeg}, timeout=5)
    assert time.monotonic() - gone_at < 5
    settle(w, baseline, keep=set(segments.keys))


def stopping_ffmpeg(directory: Path) -> Path:
    """An ffmpeg that stops itself (SIGSTOP) when asked for a reference decode."""
    from tests.support.media import FFMPEG

    wrapper = directory / "ffmpeg-stops"
    wrapper.write_text(
        "#!/bin/sh\n"
        'case "$*" in *"-pix_fmt rgb24 pipe:"*) kill -STOP $$ ;; esac\n'
        f'exec {FFMPEG} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def test_a_stalled_decode_is_killed_and_sigterm_still_stops_the_worker(workers, tmp_path):
    env = os.environ | {"FRAMEWIRE_FFMPEG": str(stopping_ffmpeg(tmp_path))}
    w = workers.start(*LIMITS, env=env)
    video = make_video(w.inputs / "v.mp4", "testsrc2=size=64x48:rate=24", 0.5)
    msg = {"op": "decode", "path": str(video), "fps": 24, "width": 64, "height": 48}
    started = time.monotonic()
    with RawConnection(w.uds.parent / "fd.sock") as conn:
        reply, fds = conn.call(msg)
    assert fds == [] and (reply["ok"], reply["code"]) == (False, "decode_failed")
    assert "no progress" in reply["message"]
    assert STALL_S <= time.monotonic() - started < STALL_S + 5
    assert w.children() == set()
    # A decode stopped again, then SIGTERM: the worker exits, it does not wait for it.
    with RawConnection(w.uds.parent / "fd.sock") as conn:
        conn.send(json.dumps(msg | {"width": 32}).encode() + b"\n")
        deadline = time.monotonic() + 10
        while not w.children():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        stopped_at = time.monotonic()
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(timeout=15) == 0
    assert time.monotonic() - stopped_at < 10


# --- connections that idle, dribble or pile up ----------------------------------------------


def closed_within(sock: socket.socket, seconds: float) -> bytes:
    """Everything the peer sent until it closed; fails if it did not close in time."""
    sock.settimeout(seconds)
    got = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        data = sock.recv(65536)
        if not data:
            return got
        got += data
    raise AssertionError("the connection was not closed")


def test_fd_socket_connections_that_dribble_are_closed_and_idle_ones_kept(worker):
    path = worker.uds.parent / "fd.sock"
    with RawConnection(path) as idle, socket.socket(socket.AF_UNIX) as dribble:
        dribble.connect(str(path))
        started = time.monotonic()
        for byte in b'{"op": "pi':
            dribble.sendall(bytes([byte]))
            time.sleep(0.05)
        assert closed_within(dribble, IDLE_S + 3) == b""
        assert time.monotonic() - started < IDLE_S + 3
        # A connection idle between requests holds a rank's regions: it is kept.
        time.sleep(max(0.0, started + 2 * IDLE_S - time.monotonic()))
        assert idle.call({"op": "ping"})[0]["ok"]


def test_fd_socket_connections_are_capped(worker):
    path = worker.uds.parent / "fd.sock"
    held = []
    try:
        for _ in range(CONNECTIONS):
            conn = RawConnection(path)
            assert conn.call({"op": "ping"})[0]["ok"]  # served: counted as open
            held.append(conn)
        with RawConnection(path) as extra:
            reply, _ = extra.reply()
            assert (reply["ok"], reply["code"]) == (False, "overloaded")
            assert closed_within(extra.sock, 3) == b""
        assert healthz(worker) == 200
    finally:
        for conn in held:
            conn.close()
    deadline = time.monotonic() + 5
    while True:  # the slots free up as the worker sees the closes
        with RawConnection(path) as conn:
            if conn.call({"op": "ping"})[0]["ok"]:
                break
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_http_connections_that_idle_or_dribble_are_closed(worker):
    for transport in ("tcp", "unix"):
        family = socket.AF_INET if transport == "tcp" else socket.AF_UNIX
        address = ("127.0.0.1", worker.port) if transport == "tcp" else str(worker.uds)
        with socket.socket(family) as silent, socket.socket(family) as slow:
            silent.connect(address)
            slow.connect(address)
            for byte in b"GET /healthz HTTP/1.1\r\nhost: x\r\n":
                slow.sendall(bytes([byte]))
                time.sleep(0.02)  # bytes keep coming, the headers never end
            assert closed_within(silent, IDLE_S + 3) == b""
            assert closed_within(slow, IDLE_S + 3) == b""
        with socket.socket(family) as body:
            body.connect(address)
            body.sendall(
                b"POST /v1/probe HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: 100\r\n\r\n" + b'{"paths": '
            )
            answer = closed_within(body, IDLE_S + 3)
            head, _, payload = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), answer
            assert json.loads(payload)["code"] == "request_timeout"
    assert healthz(worker) == 200


def sockets_of(worker: Worker) -> int:
    return sum(1 for f in worker.open_fds() if f.startswith("socket:"))


def settled_sockets(worker: Worker, quiet_s: float = 0.3) -> int:
    """The worker's socket count once it holds still: the start-up's own readiness
    connections may still be closing on a loaded machine, and counted they would make
    the baseline too high."""
    count = sockets_of(worker)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = sockets_of(worker)
        if now == count:
            return count
        count = now
    return count


def test_http_connections_are_capped(workers):
    # Its own worker with a long idle timeout: the module's closes held connections after
    # IDLE_S, and on a loaded machine that can come before all of them were seen accepted.
    worker = workers.start("--idle-timeout-s", "30", "--max-connections", str(CONNECTIONS))
    held = []
    before = settled_sockets(worker)
    try:
        # TCP gets all but the quarter kept for the ranks' Unix socket
        # (test_slots.py::test_tcp_callers_cannot_take_the_ranks_slots).
        for _ in range(CONNECTIONS - CONNECTIONS // 4 - 1):  # and healthz's makes one more
            sock = socket.create_connection(("127.0.0.1", worker.port))
            held.append(sock)
        deadline = time.monotonic() + 5
        while sockets_of(worker) < before + len(held):  # until the worker accepted them all
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", worker.port)) as ok:
            ok.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            assert ok.recv(100).startswith(b"HTTP/1.1 200")
            with socket.create_connection(("127.0.0.1", worker.port)) as extra:
                answer = closed_within(extra, 3)
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["code"] == "too_many_connections"
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while True:
        try:
            if healthz(worker, timeout=2) == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.05)


# --- regions --------------------------------------------------------------------------------


def region_fds(worker: Worker, key: str) -> int:
    return sum(1 for f in worker.open_fds() if f == f"/dev/shm{key}")


def test_unregistering_a_region_in_use_returns_at_once(worker, tmp_path):
    clip = make_clip(frames=96, height=128, width=128)
    key = f"/framewire-test-{secrets.token_hex(6)}"
    Path(f"/dev/shm{key}").write_bytes(raw_bytes(clip))
    try:
        reg = {"key": key, "offset": 0, "byte_size": len(raw_bytes(clip))}
        with worker.http() as h:
            r = h.post("/v2/systemsharedmemory/region/busy/register", json=reg)
            assert r.status_code == 200
        src = shm_source(key, clip) | {"kind": "region", "region": "busy"}
        del src["key"]
        request = Request(worker, "POST", "/v1/videos:encode",
                          json=encode_body(src, "busy.mp4", preset="veryslow"))  # fmt: skip
        wait_for_ffmpeg(worker)
        with worker.http() as h:
            started = time.monotonic()
            assert h.post("/v2/systemsharedmemory/region/busy/unregister").status_code == 200
            assert time.monotonic() - started < 1.0
            assert h.get("/v2/systemsharedmemory/status").json() == []  # gone from the registry
            r = h.post("/v1/videos:encode", json=encode_body(src, "late.mp4"))
            assert (r.status_code, r.json()["code"]) == (404, "region_not_found")
            assert region_fds(worker, key) == 1  # still mapped for the running encode
        response = request.result(timeout=120)
        assert response.status_code == 200, response.text
        assert sha256(worker.outputs / "busy.mp4") == reference_mp4(
            clip, tmp_path / "ref.mp4", preset="veryslow"
        )
        assert region_fds(worker, key) == 0  # released with its last user
        (worker.outputs / "busy.mp4").unlink()
    finally:
        Path(f"/dev/shm{key}").unlink()


# --- sockets and descriptors ----------------------------------------------------------------


def test_a_second_worker_on_the_same_sockets_leaves_the_first_alone(worker, tmp_path):
    root = worker.uds.parent
    before = {p: p.stat().st_ino for p in (worker.uds, root / "fd.sock")}
    for sockets in (["--uds", str(worker.uds)], ["--fd-socket", str(root / "fd.sock")]):
        second = run_cli("serve", "--port", "0", "--uds", str(tmp_path / "api.sock"),
                         "--fd-socket", str(tmp_path / "fd.sock"), "--output-roots",
                         str(tmp_path), "--input-roots", str(tmp_path), *sockets,
                         timeout=60)  # fmt: skip
        assert second.returncode == 1, second.stderr
        assert "another worker serves" in second.stderr and "not starting" in second.stderr
        assert not (tmp_path / "api.sock").exists() and not (tmp_path / "fd.sock").exists()
    assert {p: p.stat().st_ino for p in before} == before  # the same socket files
    assert healthz(worker) == 200
    with worker.http() as h:
        assert h.get("/healthz").status_code == 200
    with RawConnection(root / "fd.sock") as conn:
        assert conn.call({"op": "ping"})[0]["ok"]


def test_running_out_of_descriptors_is_a_503_and_passes(workers, segments):
    w = workers.start("--max-regions", "100000")
    clip = make_clip(frames=2, height=16, width=16)
    reg = {"key": segments.write(clip), "offset": 0, "byte_size": len(raw_bytes(clip))}
    with w.http() as h:
        assert h.get("/healthz").status_code == 200  # the connection we keep
        limit = len(w.open_fds()) + 12
        resource.prlimit(w.pid, resource.RLIMIT_NOFILE, (limit, limit))
        for i in range(64):
            r = h.post(f"/v2/systemsharedmemory/region/fd{i}/register", json=reg)
            if r.status_code != 200:
                break
        assert (r.status_code, r.json()["code"]) == (503, "fd_exhausted"), r.text
        # The fd socket cannot accept now; it backs off instead of spinning...
        fd_sock = w.uds.parent / "fd.sock"
        waiting = RawConnection(fd_sock)
        waiting.send(b'{"op": "ping"}\n')
        deadline = time.monotonic() + 10
        while "backing off" not in w.log.read_text():
            assert time.monotonic() < deadline, "the accept never failed"
            time.sleep(0.02)
        assert h.post("/v2/systemsharedmemory/unregister").status_code == 200
        # ...and serves the connection that waited once descriptors are free again.
        reply, _ = waiting.reply()
        waiting.close()
        assert reply["ok"]
        backoffs = w.log.read_text().count("backing off")
        assert 1 <= backoffs <= 3, w.log.read_text()


# --- outputs --------------------------------------------------------------------------------


def test_a_refused_output_leaves_no_directory_of_the_others(worker, segments):
    clip = make_clip(frames=2, height=16, width=16)
    body = {"outputs": [
        {"source": segments.source(clip), "path": "made/by/first/a.mp4", "fps": 24},
        {"source": shm_source("/framewire-none", clip), "path": "made/too/b.mp4", "fps": 24},
    ]}  # fmt: skip
    with worker.http() as h:
        r = h.post("/v1/videos:encode", json=body)
    assert (r.status_code, r.json()["code"]) == (404, "shm_not_found")
    assert not (worker.outputs / "made").exists()


def test_an_output_root_removed_under_the_worker_is_a_json_503(workers, segments):
    w = workers.start()
    clip = make_clip(frames=2, height=16, width=16)
    shutil.rmtree(w.outputs)
    with w.http() as h:
        r = h.post("/v1/videos:encode", json=encode_body(segments.source(clip), "x.mp4"))
        assert r.headers["content-type"] == "application/json"
        assert (r.status_code, r.json()["code"]) == (503, "output_root_missing")
        w.outputs.mkdir()
        r = h.post("/v1/videos:encode", json=encode_body(segments.source(clip), "x.mp4"))
        assert r.status_code == 200


def test_two_writers_of_one_file_the_answer_describes_the_file(worker, segments):
    _, src = long_clip(segments)
    first = Request(worker, "POST", "/v1/videos:encode",
                    json=encode_body(src, "same.mp4", preset="veryslow"))  # fmt: skip
    wait_for_ffmpeg(worker)
    with worker.http() as h:
        r = h.post("/v1/videos:encode", json=encode_body(segments.source(make_clip(2)), "same.mp4"))
    assert (r.status_code, r.json()["code"]) == (409, "output_busy")
    response = first.result(timeout=120)
    assert response.status_code == 200
    assert response.json()["outputs"][0]["sha256"] == sha256(worker.outputs / "same.mp4")
    (worker.outputs / "same.mp4").unlink()


# --- numbers that are not numbers -----------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("shape", ["3", 2, 16, 16], "bad_shape"),
        ("shape", [3.0, 2, 16, 16], "bad_shape"),
        ("shape", [True, 2, 16, 16], "bad_shape"),
        ("byte_size", "1536", "bad_byte_size"),
        ("offset", 0.0, "bad_offset"),
    ],
)
def test_numbers_must_be_json_integers(worker, segments, field, value, code):
    src = segments.source(make_clip(frames=2, height=16, width=16)) | {field: value}
    with worker.http() as h:
        r = h.post("/v1/videos:encode", json=encode_body(src, "n.mp4"))
    assert (r.status_code, r.json()["code"]) == (400, code), r.text


@pytest.mark.parametrize("fps", [1e-300, 0.0009, 0, -1, 1001, "24", True])
def test_fps_outside_what_ffmpeg_can_write_is_bad_fps(worker, segments, fps):
    src = segments.source(make_clip(frames=2, height=16, width=16))
    with worker.http() as h:
        r = h.post("/v1/videos:encode", json=encode_body(src, "f.mp4", fps=fps))
    assert (r.status_code, r.json()["code"]) == (400, "bad_fps"), r.text


def test_the_slowest_fps_accepted_is_written(worker, segments, tmp_path):
    clip = make_clip(frames=2, height=16, width=16)
    with worker.http() as h:
        r = h.post(
            "/v1/videos:encode", json=encode_body(segments.source(clip), "slow.mp4", fps=0.001)
        )
    assert r.status_code == 200, r.text
    assert sha256(worker.outputs / "slow.mp4") == reference_mp4(clip, tmp_path / "r.mp4", fps=0.001)
    (worker.outputs / "slow.mp4").unlink()
    assert stat.S_ISDIR(os.stat(worker.outputs).st_mode)
