"""An object output's parts go to the store while it is encoded: a real worker, moto's
S3 server on loopback, a proxy that notes when each request came and fails or stalls
them on demand.

What must hold: the object is the file, byte for byte, and appears only whole, at
CompleteMultipartUpload; part 1 (which holds what the muxer rewrites) goes last; a part
sent early that differs from the finished file is sent again; a store that fails or
stalls mid-encode ends the output with its code in bounded time, aborted, nothing left;
so does an abort, a producer gone mid-chunk, or a SIGTERM past the grace."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.support.objstore import Moto, Proxy, part_number, store_env
from tests.support.processes import framewire_temps
from tests.support.segments import Segments
from tests.support.worker import Worker, Workers

pytestmark = pytest.mark.usefixtures("fresh")  # tests/service/store/conftest.py

BUCKET = "early"
PART = 16 << 10
ARGS = ("--output-urls", f"s3://{BUCKET}/", "--upload-part-bytes", str(PART),
        "--store-timeout-s", "1", "--store-attempts", "2")  # fmt: skip
# Noise: some 15 KB a frame at 128x128, about 3 MB in 200 frames, 180 parts. The encoder
# holds some 60 to 100 frames (x264's lookahead and threads, ffmpeg's queues) before the
# first reaches the file: the tests that stop mid-stream send 160.
CLIP = torch.randint(0, 256, (3, 200, 128, 128), dtype=torch.uint8,
                     generator=torch.Generator().manual_seed(7))  # fmt: skip


@pytest.fixture(scope="module")
def eworker(proxy: Proxy, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    started = Workers(lambda: tmp_path_factory.mktemp("worker"))
    yield started.start(*ARGS, env=store_env(proxy.endpoint))
    started.stop_all()


def object_bytes(moto: Moto, key: str) -> bytes:
    return moto.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()


def open_session(h: Any, path: str, **over: Any) -> str:
    _, _, height, width = CLIP.shape
    body = {"path": path, "fps": 24, "dtype": "uint8", "height": height, "width": width}
    r = h.post("/v1/streams", json=body | over)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def stream(h: Any, segments: Segments, sid: str, t0: int, t1: int, pause: float = 0.03) -> None:
    for at in range(t0, t1, 8):
        chunk = segments.source(CLIP[:, at : min(at + 8, t1)].contiguous())
        r = h.post(f"/v1/streams/{sid}/frames", json={"first_frame": at, "source": chunk})
        assert r.status_code == 200, r.text
        time.sleep(pause)  # a VAE's pace: the file grows between chunks


def parts_gone(h: Any, segments: Segments, proxy: Proxy, name: str) -> str:
    """A session for object ``name`` sent 160 frames, and some of its parts went: its id."""
    sid = open_session(h, f"s3://{BUCKET}/{name}")
    stream(h, segments, sid, 0, 160)
    time.sleep(0.3)
    assert proxy.parts_before(time.monotonic()), "no part went while it was encoded"
    return sid


def file_sha(w: Worker, segments: Segments, name: str, **over: Any) -> str:
    """The same clip written to a file by a session: what the object must equal."""
    with w.http() as h:
        sid = open_session(h, name, **over)
        stream(h, segments, sid, 0, CLIP.shape[1], pause=0)
        r = h.post(f"/v1/streams/{sid}/finish")
    assert r.status_code == 200, r.text
    (w.outputs / name).unlink()
    return r.json()["sha256"]


@pytest.mark.parametrize("live", [False, True])
def test_a_sessions_parts_go_while_it_encodes(eworker, moto, proxy, segments, live):
    key = f"s{int(live)}.mp4"
    with eworker.http() as h:
        sid = open_session(h, f"s3://{BUCKET}/{key}", live=live)
        stream(h, segments, sid, 0, CLIP.shape[1])
        time.sleep(0.3)  # the follower's last look at the file
        asked = time.monotonic()
        assert moto.leftovers(BUCKET) == ([], [key])  # begun, not an object yet
        r = h.post(f"/v1/streams/{sid}/finish")
        done = time.monotonic()
    assert r.status_code == 200, r.text
    out = r.json()
    early = proxy.parts_before(asked)
    assert early and 1 not in early and sorted(early) == list(range(2, len(early) + 2))
    assert proxy.parts_before(done).count(1) == 1  # part 1 after the finish, once
    assert len(early) * PART >= out["bytes"] / 2, (len(early), out["bytes"])  # half, at least
    body = object_bytes(moto, key)
    assert hashlib.sha256(body).hexdigest() == out["sha256"]
    assert out["sha256"] == file_sha(eworker, segments, f"ref{int(live)}.mp4", live=live)
    assert moto.leftovers(BUCKET) == ([key], []) and framewire_temps(eworker.outputs) == []


def test_a_whole_clip_save_sends_parts_while_ffmpeg_runs(eworker, moto, proxy, segments):
    ran: list[float] = []
    stop = threading.Event()

    def watch() -> None:  # when the worker had an encoder child
        while not stop.is_set():
            if eworker.children():
                ran.append(time.monotonic())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    body = {"outputs": [{"source": segments.source(CLIP), "path": f"s3://{BUCKET}/whole.mp4",
                         "fps": 24, "preset": "slow"}]}  # fmt: skip
    try:
        with eworker.http() as h:
            r = h.post("/v1/videos:encode", json=body)
    finally:
        stop.set()
        watcher.join()
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert ran and proxy.parts_before(max(ran)), "no part went while the encoder ran"
    assert hashlib.sha256(object_bytes(moto, "whole.mp4")).hexdigest() == out["sha256"]
    assert moto.leftovers(BUCKET) == (["whole.mp4"], [])


@pytest.mark.parametrize(
    ("fault", "code"), [(500, "store_unavailable"), ("stall", "store_timeout")]
)
def test_a_store_failing_mid_stream_ends_the_session_at_once(
    eworker, moto, proxy, segments, fault, code
):
    proxy.plan = lambda m, t, n: fault if part_number(t) >= 4 else "pass"
    with eworker.http() as h:
        sid = open_session(h, f"s3://{BUCKET}/cut.mp4")
        t0 = time.monotonic()
        # The producer goes on at its pace; the session fails within the store's bounds
        # (2 attempts of 1 s each, and backoff), whether a chunk comes meanwhile or not.
        for at in range(0, CLIP.shape[1], 8):
            chunk = segments.source(CLIP[:, at : at + 8].contiguous())
            r = h.post(f"/v1/streams/{sid}/frames", json={"first_frame": at, "source": chunk})
            if r.status_code != 200:
                assert r.json()["code"] in (code, "stream_closed"), r.text
                break
            time.sleep(0.03)
        while (state := h.get(f"/v1/streams/{sid}").json())["state"] != "failed":
            assert time.monotonic() - t0 < 20, state
            time.sleep(0.1)
        assert state["error"]["code"] == code, state
        r = h.post(f"/v1/streams/{sid}/finish")
        assert (r.status_code, r.json()["code"]) == (409, "stream_closed")
    proxy.release.set()
    assert proxy.count("DELETE", "uploadId=") == 1
    assert moto.leftovers(BUCKET) == ([], []) and framewire_temps(eworker.outputs) == []
    with eworker.http() as h:  # and the worker serves on
        source = segments.source(CLIP[:, :4].contiguous())
        after = {"source": source, "path": f"s3://{BUCKET}/after.mp4", "fps": 24}
        ok = h.post("/v1/videos:encode", json={"outputs": [after]})
    assert ok.status_code == 200, ok.text


def test_an_aborted_session_leaves_no_part(eworker, moto, proxy, segments):
    with eworker.http() as h:
        sid = open_session(h, f"s3://{BUCKET}/gone.mp4")
        stream(h, segments, sid, 0, 160)
        time.sleep(0.3)
        assert proxy.parts_before(time.monotonic()), "no part went before the abort"
        assert h.delete(f"/v1/streams/{sid}").status_code == 204
    assert proxy.count("DELETE", "uploadId=") == 1
    assert moto.leftovers(BUCKET) == ([], []) and framewire_temps(eworker.outputs) == []


def test_a_producer_gone_mid_chunk_leaves_no_part(workers, moto, proxy, segments):
    """Parts went; then ffmpeg is stopped, the producer sends a chunk the pipe cannot
    take (chunks answered once ffmpeg's pipe took them here) and goes away mid-request:
    the session ends as the client's, the upload is aborted, nothing is left."""
    import socket

    from tests.support.processes import wait_until_writes_stop
    from tests.support.requests import raw_http, wait_for_ffmpeg

    w = workers.start(*ARGS, "--stream-ahead-mib", "0", env=store_env(proxy.endpoint))
    with w.http() as h:
        sid = parts_gone(h, segments, proxy, "left.mp4")
        [ffmpeg] = wait_for_ffmpeg(w)
        os.kill(ffmpeg, signal.SIGSTOP)
        chunk = segments.source(CLIP[:, 160:200].contiguous())  # 1.9 MiB: over the pipe's 1
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(w.uds))
            body = {"first_frame": 160, "source": chunk}
            sock.sendall(raw_http("POST", f"/v1/streams/{sid}/frames", body))
            wait_until_writes_stop(w.pid)  # the pump waits on the full pipe, mid-chunk
        deadline = time.monotonic() + 10
        while h.get(f"/v1/streams/{sid}").json()["state"] != "aborted":
            assert time.monotonic() < deadline, "the session outlived its producer"
            time.sleep(0.05)
    assert proxy.count("DELETE", "uploadId=") == 1
    assert moto.leftovers(BUCKET) == ([], []) and framewire_temps(w.outputs) == []


def test_sigterm_past_the_grace_leaves_no_part(workers, moto, proxy, segments):
    w = workers.start(*ARGS, "--shutdown-grace", "0.5", env=store_env(proxy.endpoint))
    with w.http() as h:
        parts_gone(h, segments, proxy, "term.mp4")
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(timeout=30) == 0
    assert proxy.count("DELETE", "uploadId=") == 1
    assert moto.leftovers(BUCKET) == ([], []) and framewire_temps(w.outputs) == []


def test_a_part_sent_early_that_differs_from_the_file_is_sent_again(
    moto, proxy, tmp_path, monkeypatch
):
    # The muxers here rewrite only part 1; this is what keeps the object right if one
    # ever rewrote more: parts sent early are checked against the finished file.
    from framewire.service._settings import Settings
    from framewire.service._store.owners import OwnedUrl
    from framewire.service._store.s3 import S3Store, Upload

    for name, value in store_env(proxy.endpoint).items():
        monkeypatch.setenv(name, value)
    store = S3Store(Settings(upload_part_bytes=1024, output_urls=[f"s3://{BUCKET}/"]))
    data = os.urandom(5000)
    path = tmp_path / "f.mp4"
    path.write_bytes(data)
    url = OwnedUrl(BUCKET, "redo.mp4")
    up = Upload(store.client(), url, threading.Event())
    started = store.multipart.begin(up)
    for number, body in ((2, data[1024:2048]), (3, b"x" * 1024)):  # part 3: since rewritten
        started.sent[number] = store.multipart.send_part(up, started.upload_id, number, body)
    fd = os.open(path, os.O_RDONLY)
    try:
        sha = hashlib.sha256(data).hexdigest()
        store.upload(fd, len(data), sha, url, threading.Event(), started)
    finally:
        os.close(fd)
        store.close()
    sent = [part_number(t) for m, t in proxy.seen if m == "PUT" and part_number(t)]
    assert sorted(sent) == [1, 2, 3, 3, 4, 5]  # 2 kept, 3 again, 1, 4 and 5 at the end
    assert object_bytes(moto, "redo.mp4") == data
    assert moto.leftovers(BUCKET) == (["redo.mp4"], [])
