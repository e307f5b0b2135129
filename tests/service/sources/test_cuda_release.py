"""A CUDA share is released by its producer at once when the worker answered, and only
once the worker has let go of it when the call ended without an answer (cancelled,
timed out, lost): the worker answers ``POST /v1/cuda/shares/{id}/release`` only while
nothing of the share is open, and refuses the share from then on. The producer's CUDA
calls are stood in for (tests/service/sources/test_cuda.py's fake_cuda); the worker and
its route are real, behind a stub that holds the encode request unanswered."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from framewire.client import BadRequest, Client, Unavailable
from framewire.client._sharing.cuda import worker_may_read
from framewire.core.errors import Conflict
from framewire.service._sources import cuda_shares
from framewire.service._sources.cuda_shares import Shares

from tests.service.sources.test_cuda import FakeCudaTensor, descriptor
from tests.support.media import make_clip, reference_mp4
from tests.support.worker import Worker, metric

SHARE = "ab" * 16


def test_a_share_is_let_go_of_only_while_nothing_of_it_is_open(monkeypatch):
    shares = Shares()
    shares.opening(SHARE)
    shares.opening(SHARE)  # two outputs, one tensor
    shares.closed(SHARE)
    assert not shares.release(SHARE)  # one still open
    shares.closed(SHARE)
    assert shares.release(SHARE)
    with pytest.raises(Conflict) as refused:
        shares.opening(SHARE)
    assert refused.value.code == "cuda_share_released"
    assert shares.release("cd" * 16)  # never seen: nothing to wait for, refused from now on
    with pytest.raises(Conflict):
        shares.opening("cd" * 16)
    shares.opening(None)  # a producer that names no share (an older client): not tracked
    monkeypatch.setattr(cuda_shares, "RELEASED_S", 0.0)
    shares.opening("ef" * 16)  # the released ones were forgotten meanwhile
    assert "ab" * 16 not in shares._released


def test_which_endings_leave_the_worker_maybe_reading():
    sent = httpx.Request("POST", "http://w/v1/videos:encode")
    timed_out = Unavailable("unreachable")
    timed_out.__cause__ = httpx.ReadTimeout("no answer", request=sent)
    never_sent = Unavailable("unreachable")
    never_sent.__cause__ = httpx.ConnectError("refused", request=sent)
    assert worker_may_read(timed_out)
    assert worker_may_read(GeneratorExit())  # a plan closed: cancelled, interrupted
    assert worker_may_read(KeyboardInterrupt())
    assert not worker_may_read(never_sent)
    assert not worker_may_read(BadRequest("refused", code="cuda_unavailable"))  # answered
    assert not worker_may_read(None)


def test_the_worker_lets_go_of_a_share_and_refuses_it_from_then_on(cpu_worker):
    body = {"outputs": [{"source": descriptor(share_id=SHARE), "path": "x.mp4", "fps": 24}]}
    with cpu_worker.http() as h:
        assert h.post(f"/v1/cuda/shares/{SHARE}/release").json() == {"released": True}
        r = h.post("/v1/videos:encode", json=body)
        assert (r.status_code, r.json()["code"]) == (409, "cuda_share_released")
        other = {"outputs": [body["outputs"][0] | {"source": descriptor(share_id="cd" * 16)}]}
        r = h.post("/v1/videos:encode", json=other)  # not released: on to the next check
        assert (r.status_code, r.json()["code"]) == (400, "cuda_unavailable")
        r = h.post("/v1/cuda/shares/not-hex/release")
        assert (r.status_code, r.json()["code"]) == (400, "bad_share_id")
    assert not (cpu_worker.outputs / "x.mp4").exists()


class Stub(http.server.ThreadingHTTPServer):
    """A worker's front that never answers an encode; a release goes to ``release``."""

    def __init__(self, release: Any):
        self.release, self.held, self.asked = release, threading.Event(), []
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Stub

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.path.startswith("/v1/videos:encode"):
            self.server.held.wait(30)  # the encode "runs": no answer
            return
        self.server.asked.append(self.path)
        body = json.dumps(self.server.release(self.path)).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # /v1/info: a worker with no fd socket to hand over on
        body = json.dumps({"instance": "stub", "sockets": {"fd_socket": "/nonexistent"}})
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stub_for() -> Iterator[Any]:
    started: list[Stub] = []

    def start(release: Any) -> Stub:
        stub = Stub(release)
        threading.Thread(target=stub.serve_forever, daemon=True).start()
        started.append(stub)
        return stub

    yield start
    for stub in started:
        stub.held.set()
        stub.shutdown()
        stub.server_close()


def _save_cut_short(url: str, fake_cuda: list[str]) -> Client:
    """A save of a (stand-in) CUDA tensor whose answer never comes within the client's
    1 s bound: Unavailable, the share not released yet."""
    client = Client(url, timeout=1.0, local_fallback=False)
    with pytest.raises(Unavailable):
        client.save_video(FakeCudaTensor(make_clip(frames=2), fake_cuda), "x.mp4", fps=24)
    return client


def test_a_save_cut_short_releases_once_the_worker_has_let_go(cpu_worker, fake_cuda, stub_for):
    w: Worker = cpu_worker

    def release(path: str) -> Any:
        with w.http() as h:  # the real worker's answer
            return h.post(path).json()

    stub = stub_for(release)
    with _save_cut_short(stub.url, fake_cuda) as client:
        assert not [c for c in fake_cuda if c.startswith("release")]  # not at the timeout
        for thread in client._release_later.threads:
            thread.join(30)
    assert [c for c in fake_cuda if c.startswith("release")] == ["release /torch_1_2_3 5"]
    [asked] = stub.asked
    share_id = asked.split("/")[4]
    body = {"outputs": [{"source": descriptor(share_id=share_id), "path": "x.mp4", "fps": 24}]}
    with w.http() as h:  # the worker will not read that share now, should its request come
        assert h.post("/v1/videos:encode", json=body).json()["code"] == "cuda_share_released"


def test_a_worker_that_does_not_let_go_keeps_the_memory_held(
    fake_cuda, stub_for, monkeypatch, caplog
):
    from framewire.client import _release

    monkeypatch.setattr(_release, "GIVE_UP_S", 1.5)
    stub = stub_for(lambda path: time.sleep(0.2) or {"released": False})  # still reading
    with _save_cut_short(stub.url, fake_cuda) as client:
        for thread in client._release_later.threads:
            thread.join(30)
    assert len(stub.asked) >= 2  # asked again until it gave up
    assert not [c for c in fake_cuda if c.startswith("release")]  # held: a leak, not a reuse
    assert "kept the GPU memory of CUDA share" in caplog.text


def test_a_tensor_torch_will_not_share_goes_by_host_a_chunk_at_a_time(
    cpu_worker, fake_cuda, tmp_path
):
    """A tensor the rank itself received over IPC (torch refuses to share it again): the
    save and a stream of it go through host memory a chunk at a time, byte-exact, each
    chunk counted by the worker; no share was armed, so none is released."""
    clip = make_clip(frames=20, height=48, width=64)
    with Client(cpu_worker.uds_url, local_fallback=False) as c, cpu_worker.http() as h:
        before = metric(h, "framewire_cuda_host_copied_chunks_total")
        saved = c.save_video(FakeCudaTensor(clip, fake_cuda, shared=False), "s.mp4", fps=24)
        with c.open_video("w.mp4", fps=24) as writer:
            video = FakeCudaTensor(clip, fake_cuda, shared=False)
            for t0 in range(0, 20, 10):
                writer.write(video[:, t0 : t0 + 10])
        copied = metric(h, "framewire_cuda_host_copied_chunks_total") - before
    want = reference_mp4(clip, tmp_path / "ref.mp4")
    assert saved.sha256 == writer.result.sha256 == want
    assert saved.route != "local"
    assert copied == fake_cuda.count("to host") >= 3  # 3 chunks of the save, 2 of the stream
    assert not [c for c in fake_cuda if c.startswith(("share", "release"))]
