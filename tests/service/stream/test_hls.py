"""The live view as HLS against a real worker: real players follow it (ffmpeg's own HLS
client, a low-latency follower over HTTP), every playlist passes the RFC 8216 checker,
the file keeps its bytes, and the view's bounds, access rules and caching hold."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import torch

from tests.support.hls_check import check_media_playlist
from tests.support.hls_follow import Follower, listed
from tests.support.http import http_client, http_get
from tests.support.identity import NOBODY, as_user
from tests.support.live import open_stream, send
from tests.support.media import FFMPEG, make_clip, sha256
from tests.support.segments import Segments
from tests.support.worker import Worker

# 120 fps: x264's 250-frame GOP makes segments of at most 2.1 s (TARGETDURATION 3), so
# a player that reloads once a target duration follows a short clip in seconds.
FPS = 120
WORKER_ARGS = ("--live-grace-s", "5")


def _frame_hashes(path: Path | str, *extra: str) -> list[str]:
    """sha256 of every decoded video frame, in order (ffmpeg's framehash)."""
    out = subprocess.run(
        [FFMPEG, "-v", "error", *extra, "-i", str(path), "-map", "0:v:0", "-f", "framehash",
         "-hash", "sha256", "-"],
        check=True, capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    return [line.rsplit(",", 1)[1].strip() for line in out.splitlines() if line[:1] != "#"]


def _playlist(url: str, **params: int) -> httpx.Response:
    query = "".join(f"&_HLS_{k}={v}" for k, v in params.items())
    return http_get(url + query, timeout=30)


def _first_part(url: str) -> str:
    """The playlist once it lists a part (a plain request waits for a whole segment)."""
    return _playlist(url, msn=0, part=0).text


def _settled(url: str, quiet_s: float = 1.5, timeout: float = 30) -> str:
    """The playlist once it lists a part and has not changed for ``quiet_s``: the encoder
    has written all it can of the frames it was given (x264 may still be catching up
    when the first part is listed, on a loaded host)."""
    text, since = _first_part(url), time.monotonic()
    deadline = since + timeout
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, "the playlist kept changing"
        time.sleep(0.1)
        now = _first_part(url)
        if now != text:
            text, since = now, time.monotonic()
    return text


def _until(predicate: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


class Producer(threading.Thread):
    """Streams ``clip`` into ``sid`` in 8-frame chunks, ``pause`` s apart, then finishes."""

    def __init__(self, worker: Worker, segments: Segments, clip: torch.Tensor, sid: str,
                 pause: float = 0.02, start: int = 0):  # fmt: skip
        super().__init__()
        self.worker, self.segments, self.clip, self.sid = worker, segments, clip, sid
        self.pause, self.first = pause, start
        self.result: dict[str, Any] = {}
        self.start()

    def run(self) -> None:
        frames = self.clip.shape[1]
        with self.worker.http() as h:
            for t0 in range(self.first, frames, 8):
                send(h, self.segments, self.sid, self.clip, t0, min(t0 + 8, frames))
                time.sleep(self.pause)
            r = h.post(f"/v1/streams/{self.sid}/finish")
            assert r.status_code == 200, r.text
            self.result = r.json()


def test_ffmpeg_follows_the_live_playlist_to_its_end(worker, segments, tmp_path):
    """ffmpeg's HLS client (no parts: whole segments, reloading the live playlist),
    started while the producer still writes, follows it to EXT-X-ENDLIST: every frame
    of the file, none missing, none changed."""
    clip = make_clip(frames=480, height=48, width=64)
    with worker.http() as h:
        opened = open_stream(h, clip, "followed.mp4", fps=FPS, live=True)
        sid, url = opened["id"], opened["hls_url"]
        for t0 in range(0, 160, 8):
            send(h, segments, sid, clip, t0, t0 + 8)
    _until(lambda: "#EXTINF" in _playlist(url).text, "no segment was complete")
    live = check_media_playlist(_playlist(url).text)
    assert not live.ended and live.segments
    out = tmp_path / "hls.mp4"
    ffmpeg = subprocess.Popen(
        [FFMPEG, "-v", "error", "-live_start_index", "0", "-i", url, "-c", "copy", str(out)],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    producer = Producer(worker, segments, clip, sid, pause=0.1, start=160)
    producer.join(120)
    _, errors = ffmpeg.communicate(timeout=60)
    assert ffmpeg.returncode == 0, errors
    final = check_media_playlist(_playlist(url).text)
    assert final.ended and final.media_sequence == 0
    assert producer.result["sha256"] == sha256(worker.outputs / "followed.mp4")
    assert _frame_hashes(out) == _frame_hashes(worker.outputs / "followed.mp4")


@pytest.mark.parametrize(
    ("profile", "audio"), [("imageio", True), ("sglang", False), ("diffusers", False)]
)
def test_the_file_keeps_its_bytes_with_hls_players_attached(
    worker, segments, tmp_path, wav, profile, audio
):
    """Low-latency followers (parts, blocking reloads) attached from the start: the file
    is the one encoded without a live view; every playlist they got is valid; what they
    got decodes to the file's frames; the segments are their parts, whole."""
    clip = make_clip(frames=160, height=48, width=64)
    over: dict[str, Any] = {"profile": profile, "fps": FPS}
    if audio:
        shutil.copy(wav, worker.inputs / "tone.wav")
        over["audio"] = str(worker.inputs / "tone.wav")
    with worker.http() as h:
        plain = open_stream(h, clip, f"{profile}-plain.mp4", **over)["id"]
        Producer(worker, segments, clip, plain, pause=0).join(60)
        opened = open_stream(h, clip, f"{profile}-hls.mp4", live=True, **over)
    followers = [Follower(opened["hls_url"]) for _ in range(2)]
    for f in followers:
        f.start()
    producer = Producer(worker, segments, clip, opened["id"], pause=0.05)
    producer.join(60)
    assert sha256(worker.outputs / f"{profile}-plain.mp4") == producer.result["sha256"]
    assert sha256(worker.outputs / f"{profile}-hls.mp4") == producer.result["sha256"]
    for f in followers:
        f.result()
        for text in f.playlists:
            check_media_playlist(text)
        assert any(k[1] is not None for k in f.got), "it followed parts, not only segments"
        got = tmp_path / "followed.mp4"
        got.write_bytes(f.media())
        assert _frame_hashes(got) == _frame_hashes(worker.outputs / f"{profile}-hls.mp4")
    final = _playlist(opened["hls_url"]).text
    done = check_media_playlist(final)
    assert done.ended and not done.preload_hint
    base = opened["hls_url"].split("live.m3u8")[0]
    for segment in done.segments:
        whole = http_get(base + segment.uri).content
        pieces = [http_get(base + p.uri).content for p in segment.parts]
        assert not pieces or whole == b"".join(pieces)


def test_a_late_joiner_starts_at_the_oldest_kept_segment(workers, segments, tmp_path):
    w = workers.start("--live-history-bytes", str(256 << 10), "--live-grace-s", "5")
    # Noise: some 800 bytes a frame (200 KB a 250-frame segment), so the 256 KiB history
    # lets the first segment go while the second is written.
    clip = torch.rand(3, 480, 48, 64, generator=torch.Generator().manual_seed(0))
    with w.http() as h:
        opened = open_stream(h, clip, "late.mp4", fps=FPS, live=True)
        url, sid = opened["hls_url"], opened["id"]
        for t0 in range(0, 400, 8):
            send(h, segments, sid, clip, t0, t0 + 8)
        # Asked for the second segment's first part: no whole segment is listed once the
        # first has gone, and a plain request would wait the full bound for one.
        _until(lambda: check_media_playlist(_playlist(url, msn=1, part=0).text).media_sequence > 0,
               "the history never moved on")  # fmt: skip
        moved = check_media_playlist(_playlist(url, msn=1, part=0).text)
        gone = http_get(url.replace("live.m3u8", "live/0.m4s"))
        assert (gone.status_code, gone.json()["code"]) == (404, "segment_gone")
        assert gone.headers["cache-control"] == "no-store"
        late = Follower(url)
        late.start()
        _until(lambda: late.got, "the late joiner got nothing")
        Producer(w, segments, clip, sid, start=400).join(60)
    late.result()
    first = min(k[0] for k in late.got)
    assert first >= moved.media_sequence > 0
    got = tmp_path / "late.mp4"
    got.write_bytes(late.media())
    frames = _frame_hashes(got)
    whole = _frame_hashes(w.outputs / "late.mp4")
    # From a keyframe on, to the end: the file's last frames, none missing.
    assert 0 < len(frames) < len(whole) and frames == whole[len(whole) - len(frames) :]


def test_blocking_reloads_wait_within_bounds_and_end_with_the_session(worker, segments):
    """A reload for a segment not written yet waits, and so does a plain request while no
    segment is whole (players refuse such a playlist); the session's end answers both
    with the final playlist. Requests the specification refuses are 400."""
    clip = torch.full((3, 96, 48, 64), 0.5)  # no scene cut: one segment, whole at the end
    with worker.http() as h:
        opened = open_stream(h, clip, "blocked.mp4", fps=FPS, live=True)
        url, sid = opened["hls_url"], opened["id"]
        send(h, segments, sid, clip, 0, 64)  # past x264's lookahead: parts come out
        now = check_media_playlist(_settled(url))
        assert not now.segments and now.pending_parts
        for params in ({"part": 1}, {"msn": 3}, {"msn": 0, "part": 99}):
            r = _playlist(url, **params)
            assert (r.status_code, r.json()["code"]) == (400, "bad_hls_request"), params
        r = http_get(url + "&_HLS_msn=x")
        assert (r.status_code, r.json()["code"]) == (400, "bad_hls_request")
        answers: dict[str, tuple[float, httpx.Response]] = {}

        def ask(name: str, **params: int) -> None:
            r = _playlist(url, **params)
            answers[name] = (time.monotonic(), r)

        def hinted() -> None:  # the part the playlist hints: it waits until written
            r = http_get(url.split("live.m3u8")[0] + (now.preload_hint or ""), timeout=30)
            answers["hint"] = (time.monotonic(), r)

        waiting = [threading.Thread(target=ask, args=("beyond",), kwargs={"msn": 2}),
                   threading.Thread(target=ask, args=("plain",)),
                   threading.Thread(target=hinted)]  # fmt: skip
        for t in waiting:
            t.start()
        time.sleep(1.0)
        assert not answers, "a playlist with nothing new was answered at once"
        send(h, segments, sid, clip, 64, 96)
        finished = time.monotonic()
        assert h.post(f"/v1/streams/{sid}/finish").status_code == 200
        for t in waiting:
            t.join(15)
        at, part = answers.pop("hint")
        assert part.status_code == 200 and part.content[4:8] == b"moof" and at - finished < 5
        for at, r in answers.values():
            assert r.status_code == 200 and at - finished < 5
            assert check_media_playlist(r.text).ended
        # After the end, any segment number: the final playlist at once.
        t = time.monotonic()
        r = _playlist(url, msn=2, part=0)
        assert r.status_code == 200 and time.monotonic() - t < 1
        assert check_media_playlist(r.text).ended
        text = h.get("/metrics").text
    assert 'framewire_hls_blocked_total{result="ended"}' in text
    assert 'framewire_hls_playlists_total{blocking="yes"}' in text
    assert 'framewire_hls_media_total{kind="part",result="waited"} 1.0' in text


def test_hls_access_caching_and_its_end(workers, segments):
    """A signed URL opens the playlist and every URI in it (they carry its query);
    without it the token and the session's owner rule apply; media is cacheable
    (publicly for as long as the signature lasts), playlists and errors never; past
    the grace after the session's end, nothing is kept."""
    w = workers.start("--token", "s3cret", "--live-grace-s", "1")
    clip = make_clip(frames=64, height=48, width=64)
    with w.http("s3cret") as h, w.http() as anonymous:
        opened = open_stream(h, clip, "access.mp4", fps=FPS, live=True)
        sid, url = opened["id"], opened["hls_url"]
        assert urlsplit(url).path == f"/v1/streams/{sid}/live.m3u8"
        assert urlsplit(url).query == urlsplit(opened["watch_url"]).query
        send(h, segments, sid, clip, 0, 64)
        _until(lambda: listed(_first_part(url))[1], "no part was written")
        r = _playlist(url, msn=0, part=0)
        assert r.headers["cache-control"] == "no-store"
        assert r.headers["content-type"] == "application/vnd.apple.mpegurl"
        assert r.headers["access-control-allow-origin"] == "*"
        playlist = check_media_playlist(r.text)
        query = urlsplit(url).query
        assert playlist.map_uri == f"live/init.mp4?{query}"
        part = http_get(url.split("live.m3u8")[0] + playlist.pending_parts[0].uri
                         if playlist.pending_parts else
                         url.split("live.m3u8")[0] + playlist.segments[0].parts[0].uri)  # fmt: skip
        assert part.status_code == 200 and part.headers["content-type"] == "video/mp4"
        cache = part.headers["cache-control"]
        assert cache.startswith("public, max-age=") and cache.endswith(", immutable")
        assert 0 < int(cache.split("=")[1].split(",")[0]) <= 900  # the signature's life
        # Without the signature: the token, and the session's owner.
        path = f"/v1/streams/{sid}/live/init.mp4"
        assert anonymous.get(f"/v1/streams/{sid}/live.m3u8").status_code == 401
        assert anonymous.get(path).status_code == 401
        with_token = h.get(path)
        assert with_token.headers["cache-control"].startswith("private, max-age=")
        text = h.get(f"/v1/streams/{sid}/live.m3u8?_HLS_msn=0&_HLS_part=0").text
        assert 'live/init.mp4"' in text and "sig=" not in text
        other = open_stream(h, clip, "other.mp4", live=True)
        assert http_get(url.replace(sid, other["id"])).status_code == 401  # not its own
        r = h.get(f"/v1/streams/{other['id']}/live.m3u8?{query}")
        assert (r.status_code, r.json()["code"]) == (403, "view_url_invalid")
        assert h.delete(f"/v1/streams/{other['id']}").status_code == 204
        for name in ("9999.m4s", "0.9999.m4s", "x.ts", "..%2Flive.mp4"):
            r = h.get(f"/v1/streams/{sid}/live/{name}")
            assert r.status_code == 404 and r.json()["code"] in ("segment_not_found", "not_found")
        assert h.post(f"/v1/streams/{sid}/finish").status_code == 200
        ended = check_media_playlist(_playlist(url).text)
        assert ended.ended
        assert http_get(url.split("live.m3u8")[0] + ended.segments[-1].uri).status_code == 200
        _until(lambda: _playlist(url).status_code == 409, "the ended view was kept past its grace")
        assert _playlist(url).json()["code"] == "stream_closed"
        text = h.get("/metrics").text
    assert 'framewire_hls_media_total{kind="part",result="hit"}' in text
    assert 'framewire_hls_media_total{kind="segment",result="gone"}' not in text
    assert 'framewire_hls_media_total{kind="segment",result="miss"}' in text
    assert "framewire_hls_requests_in_flight 0.0" in text


def test_another_user_without_the_signature_finds_no_playlist(worker, segments):
    """As ``live.mp4``: to another local user without the signed URL the playlist and
    its media do not exist; with a wrong signature they are refused."""
    clip = make_clip(frames=64, height=48, width=64)
    with worker.http() as h:
        opened = open_stream(h, clip, "mine.mp4", fps=FPS, live=True)
        sid, url = opened["id"], opened["hls_url"]
        send(h, segments, sid, clip, 0, 64)
        _until(lambda: listed(_first_part(url))[1], "no part was written")
        bad = urlsplit(url).query.replace("sig=", "sig=0")

        def peek() -> list[tuple[int, str]]:
            seen = []
            with http_client(worker.tcp_url, timeout=30) as theirs:
                for route in ("live.m3u8", "live/init.mp4", "live/0.0.m4s"):
                    for query in ("", f"?{bad}"):
                        r = theirs.get(f"/v1/streams/{sid}/{route}{query}")
                        seen.append((r.status_code, r.json()["code"]))
            return seen

        assert as_user(NOBODY, peek) == [(404, "stream_not_found"), (403, "view_url_invalid")] * 3
        assert h.delete(f"/v1/streams/{sid}").status_code == 204


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_slow_readers_of_a_segment_share_one_copy_of_it(worker, segments):
    """Thirty readers ask for one large segment and never read: each holds a slice of it
    at most, not a copy (the segment is sent from the history's own bytes)."""
    import socket

    clip = torch.randint(0, 256, (3, 260, 256, 256), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(4))  # fmt: skip
    with worker.http() as h:
        opened = open_stream(h, clip, "slow-readers.mp4", fps=FPS, live=True, dtype="uint8")
        for t0 in range(0, 260, 20):
            send(h, segments, opened["id"], clip, t0, min(t0 + 20, 260))
        assert h.post(f"/v1/streams/{opened['id']}/finish").status_code == 200
    url = opened["hls_url"].replace("live.m3u8", "live/0.m4s")
    size = len(http_get(url).content)
    assert size > 2 << 20, size  # noise: some 15 KB a frame, 250 frames to the segment
    time.sleep(0.5)
    before = _rss_kib(worker.pid)
    target = urlsplit(url)
    readers = []
    for _ in range(30):
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.connect((target.hostname, target.port))
        reader.sendall(f"GET {target.path}?{target.query} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        readers.append(reader)
    time.sleep(1.5)  # what the worker sends, it has sent: the rest waits on each reader
    grown = (_rss_kib(worker.pid) - before) << 10
    for reader in readers:
        reader.close()
    # Thirty copies would be 30 segments; a slice each (and the kernel's buffers) is not.
    assert grown < 2 * size, (grown, size)
    with worker.http() as h:  # and every slot they held is free again
        _until(lambda: "framewire_live_viewers 0.0" in h.get("/metrics").text, "viewers held")
