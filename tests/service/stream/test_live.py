"""The live view of stream sessions against a real worker: the file keeps its bytes
whether anyone watches, viewers get the whole video (late ones too) and a clean end,
and the view's bounds and access rules hold."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import torch

from tests.support.http import http_client
from tests.support.identity import NOBODY, as_user
from tests.support.live import open_stream, send
from tests.support.media import decoded_frames, make_clip, sha256
from tests.support.processes import wait_gone
from tests.support.requests import wait_for_ffmpeg
from tests.support.segments import Segments
from tests.support.worker import Worker, metric

WORKER_ARGS = ("--max-viewers", "3")
END = b'{"framewire": "end"'


class Watcher(threading.Thread):
    """A viewer reading ``live.mp4`` to its end, over its own connection."""

    def __init__(self, worker: Worker, sid: str, query: str = ""):
        super().__init__()
        self.worker, self.sid, self.query = worker, sid, query
        self.data = bytearray()
        self.status = 0
        self.start()

    def run(self) -> None:
        with self.worker.http() as h, h.stream("GET", self.url()) as r:
            self.status = r.status_code
            for block in r.iter_bytes():
                self.data += block

    def url(self) -> str:
        return f"/v1/streams/{self.sid}/live.mp4" + (f"?{self.query}" if self.query else "")

    def until(self, predicate: Any, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(bytes(self.data)):
            assert time.monotonic() < deadline, "the viewer got nothing in time"
            time.sleep(0.02)


def _end_reason(data: bytes) -> str:
    at = data.rindex(END)
    return json.loads(data[at:])["reason"]


def _stream(worker: Worker, segments: Segments, clip: torch.Tensor, path: str,
            viewers: int, **over: Any) -> tuple[dict[str, Any], list[Watcher]]:  # fmt: skip
    """Stream ``clip`` in chunks of 8 frames; ``viewers`` watch, the last one joining late
    (once fragments went out: x264's lookahead holds some 35 frames back at first)."""
    frames = clip.shape[1]
    watchers: list[Watcher] = []
    with worker.http() as h:
        opened = open_stream(h, clip, path, **over)
        sid = opened["id"]
        for _ in range(max(0, viewers - 1)):
            watchers.append(Watcher(worker, sid))
        for t0 in range(0, frames, 8):
            send(h, segments, sid, clip, t0, min(t0 + 8, frames))
        if viewers:
            if watchers:  # the early ones have had fragments already
                watchers[0].until(lambda d: b"moof" in d)
            watchers.append(Watcher(worker, sid))
            watchers[-1].until(lambda d: b"moof" in d)  # it has joined: it got the history
        r = h.post(f"/v1/streams/{sid}/finish")
        assert r.status_code == 200, r.text
    for w in watchers:
        w.join(60)
        assert not w.is_alive() and w.status == 200
    return opened | {"result": r.json()}, watchers


@pytest.mark.parametrize(
    ("profile", "audio"), [("imageio", True), ("sglang", False), ("diffusers", False)]
)
def test_the_file_keeps_its_bytes_with_and_without_viewers(
    worker, segments, tmp_path, wav, profile, audio
):
    clip = make_clip(frames=64, height=60, width=100)
    over: dict[str, Any] = {"profile": profile}
    if audio:
        shutil.copy(wav, worker.inputs / "tone.wav")
        over["audio"] = str(worker.inputs / "tone.wav")
    plain, _ = _stream(worker, segments, clip, f"{profile}-plain.mp4", 0, **over)
    alone, _ = _stream(worker, segments, clip, f"{profile}-alone.mp4", 0, live=True, **over)
    watched, watchers = _stream(worker, segments, clip, f"{profile}-watched.mp4", 2, live=True,
                                **over)  # fmt: skip
    assert plain["watch_url"] is None and alone["watch_url"] and watched["watch_url"]
    digests = {sha256(worker.outputs / f"{profile}-{n}.mp4") for n in ("plain", "alone", "watched")}
    assert len(digests) == 1
    assert plain["result"]["sha256"] in digests
    early, late = (bytes(w.data) for w in watchers)
    assert early == late, "a late viewer gets everything from the start"
    assert _end_reason(early) == "finished"
    fmp4 = tmp_path / "live.mp4"
    fmp4.write_bytes(early)
    assert decoded_frames(fmp4) == decoded_frames(worker.outputs / f"{profile}-plain.mp4")


def test_what_a_live_view_refuses(worker, segments):
    clip = make_clip(frames=8, height=48, width=64)
    with worker.http() as h:
        r = h.post("/v1/streams", json={"path": "o.mp4", "fps": 24, "dtype": "float32",
                   "height": 48, "width": 64, "profile": "vllm-omni", "live": True})  # fmt: skip
        assert (r.status_code, r.json()["code"]) == (400, "live_unsupported")
        assert not (worker.outputs / "o.mp4").exists()
        plain = open_stream(h, clip, "plain.mp4")["id"]
        for route in ("live.mp4", "watch"):
            r = h.get(f"/v1/streams/{plain}/{route}")
            assert (r.status_code, r.json()["code"]) == (409, "live_not_enabled")
        r = h.get("/v1/streams/0123456789abcdef/live.mp4")
        assert (r.status_code, r.json()["code"]) == (404, "stream_not_found")
        opened = open_stream(h, clip, "live.mp4", live=True)
        sid = opened["id"]
        other = open_stream(h, clip, "other.mp4", live=True)
        r = h.get(f"/v1/streams/{sid}/live.mp4?{urlsplit(other['watch_url']).query}")
        assert (r.status_code, r.json()["code"]) == (403, "view_url_invalid")  # not its own
        assert h.delete(f"/v1/streams/{other['id']}").status_code == 204
        # Viewers past the worker's cap (3 here) are refused; the others go on.
        watchers = [Watcher(worker, sid) for _ in range(3)]
        _viewers_reach(h, 3)  # each joins on its own thread
        r = h.get(f"/v1/streams/{sid}/live.mp4")
        assert (r.status_code, r.json()["code"]) == (429, "too_many_viewers")
        send(h, segments, sid, clip, 0, 8)
        assert h.delete(f"/v1/streams/{sid}").status_code == 204
        for w in watchers:
            w.join(30)
            assert _end_reason(bytes(w.data)) == "aborted"
        r = h.get(f"/v1/streams/{sid}/watch")
        assert (r.status_code, r.json()["code"]) == (409, "stream_closed")
        assert h.delete(f"/v1/streams/{plain}").status_code == 204
        pipes_then = _pipes(worker)
        # Nothing of a live session remains after it ends: its pipe is closed.
        another = open_stream(h, clip, "gone.mp4", live=True)["id"]
        send(h, segments, another, clip, 0, 8)
        assert _pipes(worker) > pipes_then  # its ffmpeg's input, its live view
        assert h.delete(f"/v1/streams/{another}").status_code == 204
        assert _pipes(worker) == pipes_then
        assert metric(h, "framewire_live_viewers") == 0


def _viewers_reach(h: httpx.Client, n: int) -> None:
    deadline = time.monotonic() + 30
    while metric(h, "framewire_live_viewers") < n:
        assert time.monotonic() < deadline, f"{n} viewers never joined"
        time.sleep(0.02)


def _pipes(worker: Worker) -> int:
    return sum(p.startswith("pipe:") for p in worker.open_fds())


def test_a_signed_url_opens_the_view_without_the_token(workers, segments):
    w = workers.start("--token", "s3cret")
    clip = make_clip(frames=16, height=48, width=64)
    with w.http("s3cret") as h, w.http() as anonymous:
        opened = open_stream(h, clip, "signed.mp4", live=True)
        sid, url = opened["id"], urlsplit(opened["watch_url"])
        assert url.path == f"/v1/streams/{sid}/watch"
        fresh = h.get(f"/v1/streams/{sid}").json()["watch_url"]  # signed anew, for later
        assert urlsplit(fresh).path == url.path and "sig=" in fresh
        assert anonymous.get(url.path).status_code == 401
        page = anonymous.get(f"{url.path}?{url.query}")
        assert page.status_code == 200
        policy = page.headers["content-security-policy"]
        nonce = policy.split("'nonce-")[1].split("'")[0]
        assert "default-src 'none'" in policy and f'<script nonce="{nonce}">' in page.text
        assert "<script src" not in page.text
        bad = url.query.replace("sig=", "sig=0")
        assert anonymous.get(f"{url.path}?{bad}").status_code == 401
        # The signature opens this session's view routes, nothing else.
        assert anonymous.get(f"/v1/streams/{sid}?{url.query}").status_code == 401
        viewer = Watcher(w, sid, url.query)
        _viewers_reach(h, 1)  # watching before the end (after it: 409 stream_closed)
        for t0 in (0, 8):
            send(h, segments, sid, clip, t0, t0 + 8)
        assert h.post(f"/v1/streams/{sid}/finish").status_code == 200
        viewer.join(30)
        assert viewer.status == 200 and _end_reason(bytes(viewer.data)) == "finished"
        metrics = h.get("/metrics").text
    assert "framewire_live_viewers 0.0" in metrics
    assert (
        "framewire_live_bytes_total" in metrics and "framewire_live_delay_seconds_count" in metrics
    )


def test_the_async_writer_exposes_the_watch_url(worker):
    from framewire.client import AsyncClient

    clip = make_clip(frames=16, height=48, width=64)

    async def run() -> tuple[str | None, Any]:
        async with AsyncClient(worker.uds_url) as client:
            writer = client.open_video("async-live.mp4", fps=24, live=True)
            async with writer:
                await writer.write(clip[:, :8])
                url = writer.watch_url
                page = await asyncio.to_thread(httpx.get, url or "", timeout=30)
                assert page.status_code == 200 and "<video" in page.text
                await writer.write(clip[:, 8:])
            return url, writer.result

    url, result = asyncio.run(run())
    assert url is not None and url.startswith(f"http://127.0.0.1:{worker.port}/v1/streams/")
    assert result is not None and result.ok


def test_a_viewer_that_goes_away_is_let_go_at_once(worker, segments):
    clip = make_clip(frames=8, height=48, width=64)
    with worker.http() as h:
        sid = open_stream(h, clip, "left.mp4", live=True)["id"]
        drops = _drops(h, "gone")
        with worker.http() as v, v.stream("GET", f"/v1/streams/{sid}/live.mp4") as r:
            assert r.status_code == 200
            _viewers_reach(h, 1)
        deadline = time.monotonic() + 10
        while metric(h, "framewire_live_viewers") > 0:  # while the session still runs
            assert time.monotonic() < deadline, "the viewer's response outlived its client"
            time.sleep(0.02)
        assert _drops(h, "gone") == drops + 1
        assert h.get(f"/v1/streams/{sid}").json()["state"] == "open"
        assert h.delete(f"/v1/streams/{sid}").status_code == 204


def _drops(h: httpx.Client, cause: str) -> float:
    text = h.get("/metrics").text
    for line in text.splitlines():
        if line.startswith(f'framewire_live_drops_total{{cause="{cause}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_a_viewer_that_does_not_read_is_dropped_and_the_encode_goes_on(worker, segments):
    # Noise at CRF 0: some 12 MiB of video, past a viewer's 8 MiB queue and the sockets.
    frames, side = 128, 256
    clip = torch.rand(3, frames, side, side, generator=torch.Generator().manual_seed(3))
    with worker.http() as h:
        sid = open_stream(h, clip, "unwatched.mp4", live=True, quality=10)["id"]
        drops = _drops(h, "too_slow")
        with worker.http() as v, v.stream("GET", f"/v1/streams/{sid}/live.mp4") as r:
            assert r.status_code == 200
            for t0 in range(0, frames, 8):  # the viewer reads nothing meanwhile
                send(h, segments, sid, clip, t0, t0 + 8)
            finished = h.post(f"/v1/streams/{sid}/finish")
            assert finished.status_code == 200, finished.text
            data = b"".join(r.iter_bytes())
        assert _end_reason(data) == "too_slow"
        assert finished.json()["bytes"] > 8 << 20  # more than the queue holds
        assert _drops(h, "too_slow") == drops + 1


def test_a_killed_encode_ends_its_viewers_and_leaves_nothing(worker, segments):
    clip = make_clip(frames=8, height=64, width=64)
    with worker.http() as h:
        sid = open_stream(h, clip, "killed.mp4", live=True)["id"]
        pipes = _pipes(worker)
        viewer = Watcher(worker, sid)
        _viewers_reach(h, 1)
        send(h, segments, sid, clip, 0, 4)
        [ffmpeg] = wait_for_ffmpeg(worker)
        os.kill(ffmpeg, signal.SIGKILL)
        wait_gone({ffmpeg})
        source = segments.source(clip[:, 4:].contiguous())
        r = h.post(f"/v1/streams/{sid}/frames", json={"first_frame": 4, "source": source})
        assert (r.status_code, r.json()["code"]) == (422, "ffmpeg_killed")
        viewer.join(30)
        assert viewer.status == 200 and _end_reason(bytes(viewer.data)) == "failed"
        assert _pipes(worker) <= pipes and metric(h, "framewire_live_viewers") == 0
    assert not (worker.outputs / "killed.mp4").exists()


def _view_as(uid: int, url: str, path: str) -> tuple[int, str | None]:
    """Another local user asks for a view route over loopback TCP: the status, and the
    error's code (a viewer's 200 is read no further)."""

    def ask() -> tuple[int, str | None]:
        with http_client(url, timeout=60) as client, client.stream("GET", path) as r:
            if r.status_code == 200:
                return 200, None
            return r.status_code, json.loads(r.read())["code"]

    answer = as_user(uid, ask)
    assert isinstance(answer, tuple), answer
    return answer


def test_a_live_view_is_its_openers_unless_a_signed_url_hands_it_on(worker, segments):
    """Without a signed URL, another user who learns a session's id is answered as by the
    session's other routes: it does not exist. The signed URL opens it to whoever holds it."""
    clip = make_clip(frames=8, height=48, width=64)
    with worker.http() as h:
        opened = open_stream(h, clip, "owned-live.mp4", live=True)
        sid, signed = opened["id"], urlsplit(opened["watch_url"]).query
        send(h, segments, sid, clip, 0, 8)
        for route in ("live.mp4", "watch"):
            path = f"/v1/streams/{sid}/{route}"
            assert _view_as(NOBODY, worker.tcp_url, path) == (404, "stream_not_found"), route
            assert _view_as(NOBODY, worker.tcp_url, f"{path}?{signed}") == (200, None), route
            bad = signed.replace("sig=", "sig=0")
            assert _view_as(NOBODY, worker.tcp_url, f"{path}?{bad}") == (403, "view_url_invalid")
        assert _view_as(NOBODY, worker.tcp_url, f"/v1/streams/{sid}")[0] == 404  # as state
        owner = Watcher(worker, sid)  # the opener needs no signature
        _viewers_reach(h, 1)
        assert h.delete(f"/v1/streams/{sid}").status_code == 204
        owner.join(30)
        assert owner.status == 200 and _end_reason(bytes(owner.data)) == "aborted"
        # Ended: to the opener it is closed, to anyone else it still does not exist.
        r = h.get(f"/v1/streams/{sid}/live.mp4")
        assert (r.status_code, r.json()["code"]) == (409, "stream_closed")
        path = f"/v1/streams/{sid}/live.mp4"
        assert _view_as(NOBODY, worker.tcp_url, path) == (404, "stream_not_found")
        assert metric(h, "framewire_live_viewers") == 0


def test_a_malformed_expiry_is_a_wrong_signature(workers, worker, segments):
    """``exp`` values ``str.isdigit`` takes and ``int`` does not (a superscript, more than
    4300 digits) are answered as any wrong signature, with or without the token."""
    clip = make_clip(frames=8, height=48, width=64)
    tokened = workers.start("--token", "s3cret")
    for w, token, refusal in (
        (worker, None, (403, "view_url_invalid")),
        (tokened, "s3cret", (401, "unauthorized")),
    ):
        with w.http(token) as h, w.http() as anonymous:
            sid = open_stream(h, clip, "expiry.mp4", live=True)["id"]
            for exp in ("\u00b2", "9" * 5000, "\u0661" * 12):
                for route in ("live.mp4", "watch"):
                    r = anonymous.get(f"/v1/streams/{sid}/{route}", params={"exp": exp, "sig": "0"})
                    assert (r.status_code, r.json()["code"]) == refusal, (exp[:8], route, r.text)
            assert h.get("/healthz").status_code == 200  # still serving
            assert h.delete(f"/v1/streams/{sid}").status_code == 204


def _noise(frames: int) -> torch.Tensor:
    """Frames x264 cannot squeeze (at CRF 0 some 90 KiB each): a stream far bigger than
    what sockets hold for a viewer that does not read."""
    return torch.rand(3, frames, 256, 256, generator=torch.Generator().manual_seed(5))


def _stuck_viewer(worker: Worker, sid: str) -> tuple[httpx.Client, httpx.Response]:
    """A viewer that reads nothing yet (over the Unix socket, where what the kernel
    holds for it is the worker's send buffer, some 200 KiB)."""
    client = worker.http()
    response = client.send(client.build_request("GET", f"/v1/streams/{sid}/live.mp4"), stream=True)
    assert response.status_code == 200
    return client, response


def _ended_with_a_stuck_viewer(
    worker: Worker, h: httpx.Client, segments: Segments, name: str, clip: torch.Tensor
) -> tuple[httpx.Client, httpx.Response]:
    """A session whose whole video went to a viewer that read none of it, then finished."""
    watching = metric(h, "framewire_live_viewers")
    sid = open_stream(h, clip, name, live=True, quality=10)["id"]
    send(h, segments, sid, clip, 0, clip.shape[1])
    viewer = _stuck_viewer(worker, sid)
    _viewers_reach(h, watching + 1)
    finished = h.post(f"/v1/streams/{sid}/finish")
    assert finished.status_code == 200, finished.text
    (worker.outputs / name).unlink()
    return viewer


def test_viewers_of_ended_sessions_count_against_the_cap(workers, segments):
    w = workers.start("--max-viewers", "2")
    clip = _noise(48)
    with w.http() as h:
        stuck = [_ended_with_a_stuck_viewer(w, h, segments, f"ended{i}.mp4", clip) for i in (0, 1)]
        sid = open_stream(h, clip, "third.mp4", live=True)["id"]
        try:
            with w.http() as v, v.stream("GET", f"/v1/streams/{sid}/live.mp4") as r:
                status = r.status_code
                code = json.loads(r.read())["code"] if status != 200 else None
            assert (status, code) == (429, "too_many_viewers"), "ended sessions' viewers escaped"
        finally:
            for client, response in stuck:  # they go away: their slots are free again
                response.close()
                client.close()
        deadline = time.monotonic() + 30
        while metric(h, "framewire_live_viewers") > 0:
            assert time.monotonic() < deadline, "viewers gone kept their slots"
            time.sleep(0.05)
        viewer = Watcher(w, sid)
        _viewers_reach(h, 1)
        assert h.delete(f"/v1/streams/{sid}").status_code == 204
        viewer.join(30)
        assert viewer.status == 200 and _end_reason(bytes(viewer.data)) == "aborted"


def test_a_slow_viewer_of_an_ended_session_keeps_nothing_past_the_grace(workers, segments):
    """What an ended session's viewer has not taken within FRAMEWIRE_LIVE_GRACE_S is
    dropped (the history it joined with too): its stream ends as too_slow, and its slot
    is free once it has read that end."""
    w = workers.start(env={**os.environ, "FRAMEWIRE_LIVE_GRACE_S": "1"})
    clip = _noise(48)
    with w.http() as h:
        drops = _drops(h, "too_slow")
        client, response = _ended_with_a_stuck_viewer(w, h, segments, "slow.mp4", clip)
        try:
            deadline = time.monotonic() + 20
            while _drops(h, "too_slow") == drops:
                assert time.monotonic() < deadline, "the ended session's slow viewer was never cut"
                time.sleep(0.1)
            data = b"".join(response.iter_bytes())
        finally:
            response.close()
            client.close()
        assert _end_reason(data) == "too_slow"
        assert len(data) < 2 << 20, "the viewer got its whole stream"  # the video: ~4.5 MiB
        deadline = time.monotonic() + 10
        while metric(h, "framewire_live_viewers") > 0:
            assert time.monotonic() < deadline, "the cut viewer kept its slot"
            time.sleep(0.05)
