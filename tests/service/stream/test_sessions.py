"""Stream sessions against a real worker: bytes, every source kind, order, ends, limits.

The promise: whatever the chunking, the finished file is byte-identical to an
encode of the concatenated frames (the imageio reference); and a session that
does not finish leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from framewire.client.wire import Layout
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import REPO
from tests.support.http import http_client
from tests.support.identity import NOBODY, as_nobody
from tests.support.media import make_clip, reference_mp4, sha256
from tests.support.processes import framewire_temps, wait_until_writes_stop
from tests.support.real import needs_root
from tests.support.requests import Baseline, Request, raw_http, settle, wait_for_ffmpeg
from tests.support.segments import Segments, raw_bytes, shm_source
from tests.support.worker import Worker, metric

# Chunks of 1 MiB at most are converted: a chunk can be larger than the budget.
WORKER_ARGS = ("--chunk-bytes", str(1 << 20), "--stream-idle-s", "30", "--max-streams", "4")


def open_stream(h: Any, clip: torch.Tensor, layout: Layout = Layout.CTHW, **over: Any) -> str:
    _, _, height, width = layout.dims(tuple(clip.shape))
    dtype = str(clip.dtype).removeprefix("torch.")
    body = {"path": "s.mp4", "fps": 24, "dtype": dtype, "layout": layout.value,
            "height": height, "width": width} | over  # fmt: skip
    r = h.post("/v1/streams", json=body)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def send_frames(h: Any, segments: Segments, sid: str, clip: torch.Tensor, t0: int, t1: int) -> Any:
    """POST frames ``[t0, t1)`` of CTHW ``clip`` to the session, from a new segment."""
    source = segments.source(clip[:, t0:t1].contiguous())
    return h.post(f"/v1/streams/{sid}/frames", json={"first_frame": t0, "source": source})


def frames_of(clip: torch.Tensor, layout: Layout, t0: int, t1: int) -> torch.Tensor:
    part = clip[:, t0:t1] if layout is Layout.CTHW else clip[t0:t1]
    return part.contiguous()


def stream(
    worker: Worker,
    segments: Segments,
    clip: torch.Tensor,
    sizes: list[int],
    layout: Layout = Layout.CTHW,
    **over: Any,
) -> dict[str, Any]:
    """Open, send ``clip`` in chunks of ``sizes`` frames, finish; the finish answer."""
    with worker.http() as h:
        sid = open_stream(h, clip, layout, **over)
        t0 = 0
        for n in sizes:
            chunk = frames_of(clip, layout, t0, t0 + n)
            body = {"first_frame": t0, "source": segments.source(chunk, layout.value)}
            r = h.post(f"/v1/streams/{sid}/frames", json=body)
            assert r.status_code == 200, r.text
            t0 += n
            assert r.json() == {"frames_received": t0}
        r = h.post(f"/v1/streams/{sid}/finish")
        assert r.status_code == 200, r.text
        return r.json()


def chunkings(total: int) -> st.SearchStrategy[list[int]]:
    """Lists of chunk sizes that add up to ``total``."""
    cuts = st.lists(st.integers(1, total - 1), unique=True, max_size=min(6, total - 1))
    return cuts.map(
        lambda c: [b - a for a, b in zip([0, *sorted(c)], [*sorted(c), total], strict=True)]
    )


@settings(max_examples=10, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(data=st.data())
def test_any_chunking_gives_the_bytes_of_one_encode(worker, segments, tmp_path, data):
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.uint8]))
    layout = data.draw(st.sampled_from(list(Layout)))
    frames = data.draw(st.integers(2, 9))
    height, width = data.draw(st.sampled_from([(16, 16), (17, 30), (33, 21)]))
    fps = data.draw(st.sampled_from([24, 23.976]))
    sizes = data.draw(chunkings(frames))
    clip = make_clip(frames=frames, height=height, width=width, dtype=dtype, layout=layout, seed=3)
    result = stream(worker, segments, clip, sizes, layout, fps=fps)
    expected = reference_mp4(clip, tmp_path / "ref.mp4", layout=layout, fps=fps)
    assert result["sha256"] == expected == sha256(worker.outputs / "s.mp4")
    assert result["frames"] == frames and result["route"] == "stream"
    (worker.outputs / "s.mp4").unlink()


@pytest.mark.parametrize(
    ("name", "sizes", "shape"),
    [
        ("one frame at a time", [1] * 8, (8, 48, 64)),
        ("uneven", [5, 1, 2], (8, 48, 64)),
        ("one chunk over the conversion budget", [3, 9], (12, 240, 320)),
    ],
)
def test_chunkings_at_the_edges(worker, segments, tmp_path, name, sizes, shape):
    frames, height, width = shape
    clip = make_clip(frames=frames, height=height, width=width)
    result = stream(worker, segments, clip, sizes)
    assert result["sha256"] == reference_mp4(clip, tmp_path / "ref.mp4"), name
    (worker.outputs / "s.mp4").unlink()


def test_with_audio(worker, segments, tmp_path, wav):
    (worker.inputs / "tone.wav").write_bytes(wav.read_bytes())
    clip = make_clip(frames=12, height=48, width=64)
    result = stream(worker, segments, clip, [4, 8], audio="tone.wav", frames=12)
    assert result["audio"] is not None
    assert result["sha256"] == reference_mp4(clip, tmp_path / "ref.mp4", audio=wav)
    (worker.outputs / "s.mp4").unlink()


def test_a_profile_and_audio_from_memory(worker, segments, tmp_path):
    from tests.service.encode.test_profiles import waveform
    from tests.support.engines import sglang_save

    clip = make_clip(frames=12, height=30, width=34)
    audio = waveform(6000, 2)
    key = segments.write(audio.tobytes())
    memory = {"kind": "shm", "key": key, "dtype": "float32", "shape": list(audio.shape),
              "sample_rate": 24000, "byte_size": audio.nbytes}  # fmt: skip
    result = stream(worker, segments, clip, [5, 7], fps=23.976, quality=5.5, profile="sglang",
                    audio=memory)  # fmt: skip
    want = sglang_save(clip, tmp_path / "ref.mp4", fps=23.976, output_compression=55,
                       audio=audio, sample_rate=24000)  # fmt: skip
    assert result["sha256"] == want
    (worker.outputs / "s.mp4").unlink()


def test_a_registered_region_reused_for_every_chunk(worker, segments, tmp_path):
    """What a producer does with one buffer: rewrite it between chunks, once each is answered."""
    clip = make_clip(frames=9, height=48, width=64)
    chunk_bytes = len(raw_bytes(clip[:, :3].contiguous()))
    key = segments.write(b"\0" * chunk_bytes)
    with worker.http() as h:
        reg = {"key": key, "offset": 0, "byte_size": chunk_bytes}
        assert h.post("/v2/systemsharedmemory/region/buf/register", json=reg).status_code == 200
        sid = open_stream(h, clip)
        for t0 in (0, 3, 6):
            chunk = clip[:, t0 : t0 + 3].contiguous()
            Path(f"/dev/shm{key}").write_bytes(raw_bytes(chunk))  # reused at once after the answer
            source = shm_source(key, chunk) | {"kind": "region", "region": "buf"}
            del source["key"]
            r = h.post(f"/v1/streams/{sid}/frames", json={"first_frame": t0, "source": source})
            assert r.status_code == 200, r.text
        r = h.post(f"/v1/streams/{sid}/finish")
        h.post("/v2/systemsharedmemory/region/buf/unregister")
    assert r.json()["sha256"] == reference_mp4(clip, tmp_path / "ref.mp4")
    (worker.outputs / "s.mp4").unlink()


def test_misfit_chunks_are_refused_and_the_session_goes_on(worker, segments, tmp_path):
    clip = make_clip(frames=6, height=48, width=64)
    with worker.http() as h:
        sid = open_stream(h, clip, frames=6)

        def send(t0: int, chunk: torch.Tensor) -> tuple[int, str]:
            r = h.post(f"/v1/streams/{sid}/frames",
                       json={"first_frame": t0, "source": segments.source(chunk)})  # fmt: skip
            return r.status_code, r.json().get("code", "")

        assert send(0, clip[:, :2].contiguous()) == (200, "")
        assert send(0, clip[:, :2].contiguous()) == (409, "out_of_order")  # sent again
        assert send(1, clip[:, 1:3].contiguous()) == (409, "out_of_order")  # overlapping
        assert send(5, clip[:, 5:6].contiguous()) == (409, "out_of_order")  # a gap
        assert send(2, make_clip(frames=2, height=48, width=32)) == (400, "bad_shape")
        assert send(2, clip[:, 2:4].to(torch.float16).contiguous()) == (400, "bad_dtype")
        assert send(2, clip[:, 2:4].permute(1, 0, 2, 3).contiguous())[0] == 400  # layout
        assert send(2, make_clip(frames=5, height=48, width=64)) == (400, "too_many_frames")
        assert send(2, clip[:, 2:6].contiguous()) == (200, "")  # the session went on
        r = h.post(f"/v1/streams/{sid}/finish")
        assert r.status_code == 200
        assert r.json()["sha256"] == reference_mp4(clip, tmp_path / "ref.mp4")
        # Ended: every later request is 409 stream_closed; an unknown id is 404.
        assert send(6, clip[:, :1].contiguous()) == (409, "stream_closed")
        assert h.post(f"/v1/streams/{sid}/finish").json()["code"] == "stream_closed"
        assert h.delete(f"/v1/streams/{sid}").json()["code"] == "stream_closed"
        assert h.get(f"/v1/streams/{sid}").json()["state"] == "done"
        chunk = {"first_frame": 0, "source": segments.source(clip)}
        missing = h.post("/v1/streams/nope/frames", json=chunk)
        assert (missing.status_code, missing.json()["code"]) == (404, "stream_not_found")
    (worker.outputs / "s.mp4").unlink()


def test_an_unreadable_or_truncated_chunk_fails_the_session(worker, segments):
    baseline = Baseline.of(worker)
    clip = make_clip(frames=4, height=48, width=64)
    with worker.http() as h:
        sid = open_stream(h, clip, path="gone/a.mp4")
        src = segments.source(clip[:, :2].contiguous())
        r = h.post(f"/v1/streams/{sid}/frames", json={"first_frame": 0, "source": src})
        assert r.status_code == 200
        src = shm_source("/framewire-test-none", clip[:, 2:].contiguous())
        r = h.post(f"/v1/streams/{sid}/frames", json={"first_frame": 2, "source": src})
        assert (r.status_code, r.json()["code"]) == (404, "shm_not_found")
        state = h.get(f"/v1/streams/{sid}").json()
        assert state["state"] == "failed" and state["error"]["code"] == "shm_not_found"
        # Truncated: the segment is smaller than the descriptor says.
        sid = open_stream(h, clip, path="short.mp4")
        src = segments.source(clip[:, :2].contiguous())
        os.truncate(f"/dev/shm{src['key']}", 100)
        r = h.post(f"/v1/streams/{sid}/frames", json={"first_frame": 0, "source": src})
        assert (r.status_code, r.json()["code"]) == (400, "segment_too_small")
        assert h.post(f"/v1/streams/{sid}/finish").json()["code"] == "stream_closed"
    assert not (worker.outputs / "gone").exists() and not (worker.outputs / "short.mp4").exists()
    settle(worker, baseline, keep=set(segments.keys))


def test_delete_leaves_nothing_and_finish_without_frames_is_refused(worker, segments):
    baseline = Baseline.of(worker)
    clip = make_clip(frames=4, height=48, width=64)
    with worker.http() as h:
        sid = open_stream(h, clip, path="new/dir/d.mp4")
        assert send_frames(h, segments, sid, clip, 0, 2).is_success
        assert h.delete(f"/v1/streams/{sid}").status_code == 204
        assert h.get(f"/v1/streams/{sid}").json()["state"] == "aborted"
        sid = open_stream(h, clip, path="empty.mp4")
        r = h.post(f"/v1/streams/{sid}/finish")
        assert (r.status_code, r.json()["code"]) == (400, "empty_stream")
        sid = open_stream(h, clip, path="short.mp4", frames=4)
        src = segments.source(clip[:, :2].contiguous())
        h.post(f"/v1/streams/{sid}/frames", json={"first_frame": 0, "source": src})
        r = h.post(f"/v1/streams/{sid}/finish")
        assert (r.status_code, r.json()["code"]) == (400, "frame_count_mismatch")
        assert r.json()["outputs"][0]["ok"] is False
    assert not (worker.outputs / "new").exists()
    assert (
        not (worker.outputs / "empty.mp4").exists() and not (worker.outputs / "short.mp4").exists()
    )
    settle(worker, baseline, keep=set(segments.keys))


def test_the_output_is_claimed_while_the_session_is_open(worker, segments):
    clip = make_clip(frames=2, height=48, width=64)
    with worker.http() as h:
        sid = open_stream(h, clip, path="claimed.mp4")
        r = h.post("/v1/streams", json={"path": "claimed.mp4", "fps": 24, "dtype": "float32",
                                        "height": 48, "width": 64})  # fmt: skip
        assert (r.status_code, r.json()["code"]) == (409, "output_busy")
        body = {"outputs": [{"source": segments.source(clip), "path": "claimed.mp4", "fps": 24}]}
        assert h.post("/v1/videos:encode", json=body).json()["code"] == "output_busy"
        assert h.delete(f"/v1/streams/{sid}").status_code == 204


def test_at_most_max_streams_are_open(worker, segments):
    clip = make_clip(frames=2, height=48, width=64)
    with worker.http() as h:
        ids = [open_stream(h, clip, path=f"m{i}.mp4") for i in range(4)]
        r = h.post("/v1/streams", json={"path": "m4.mp4", "fps": 24, "dtype": "float32",
                                        "height": 48, "width": 64})  # fmt: skip
        assert (r.status_code, r.json()["code"]) == (429, "too_many_streams")
        assert int(r.headers["retry-after"]) >= 1
        assert metric(h, "framewire_streams_open") == 4
        for sid in ids:
            assert h.delete(f"/v1/streams/{sid}").status_code == 204
        assert metric(h, "framewire_streams_open") == 0
        assert metric(h, 'framewire_stream_aborts_total{cause="deleted"}') >= 4


def open_streams(url: str, bodies: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """POST each body to /v1/streams over ``url``: (status, answer) each."""
    with http_client(url, timeout=60) as c:
        return [(r.status_code, r.json()) for r in (c.post("/v1/streams", json=b) for b in bodies)]


@needs_root
def test_one_caller_opens_its_share_of_the_sessions_and_the_ranks_still_open_theirs(workers):
    w = workers.start(*WORKER_ARGS, "--allowed-uids", f"{os.getuid()},{NOBODY}")
    w.outputs.chmod(0o777)  # another user may write there: the share is all that stops it
    body = {"fps": 24, "dtype": "float32", "height": 48, "width": 64}
    theirs = as_nobody(open_streams, w.tcp_url, [body | {"path": f"n{i}.mp4"} for i in range(4)])
    assert isinstance(theirs, list), theirs
    got = [(status, answer.get("code")) for status, answer in theirs]
    # FRAMEWIRE_USER_SHARE (0.5) of FRAMEWIRE_MAX_STREAMS (4): two.
    assert got == [(201, None), (201, None), (429, "user_share"), (429, "user_share")], got
    clip = make_clip(frames=2, height=48, width=64)
    with w.http() as h:  # the worker's own uid (the ranks) is not limited
        mine = [open_stream(h, clip, path=f"r{i}.mp4") for i in range(2)]
        assert metric(h, "framewire_streams_open") == 4
        for sid in mine + [answer["id"] for status, answer in theirs if status == 201]:
            assert h.delete(f"/v1/streams/{sid}").status_code == 204
    assert list(w.outputs.iterdir()) == []


def test_a_session_holds_its_cpu_slots_from_first_chunk_to_end(workers, segments, tmp_path):
    # No small lane: the tiny encode must wait for the slot the session holds.
    w = workers.start("--cpu-slots", "1", "--small-encode-bytes", "0")
    clip = make_clip(frames=4, height=48, width=64)
    with w.http() as h:
        sid = open_stream(h, clip)
        encode = {"outputs": [{"source": segments.source(clip), "path": "e.mp4", "fps": 24}]}
        # Open, no chunk yet: it holds nothing, an encode runs at once.
        assert h.post("/v1/videos:encode", json=encode).status_code == 200
        assert send_frames(h, segments, sid, clip, 0, 2).is_success
        waiting = Request(w, "POST", "/v1/videos:encode", json=encode | {"outputs": [
            encode["outputs"][0] | {"path": "e2.mp4"}]})  # fmt: skip
        deadline = time.monotonic() + 10
        while metric(h, "framewire_encodes_waiting") < 1:  # the session has the slot
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert send_frames(h, segments, sid, clip, 2, 4).is_success
        assert h.post(f"/v1/streams/{sid}/finish").status_code == 200
        response = waiting.result()
    assert response.status_code == 200
    assert response.json()["outputs"][0]["timings"]["queue_ms"] > 0


def test_an_idle_session_is_aborted_and_leaves_nothing(workers, segments):
    w = workers.start("--stream-idle-s", "1", "--log-format", "json")
    baseline = Baseline.of(w)
    clip = make_clip(frames=4, height=48, width=64)
    with w.http() as h:
        sid = open_stream(h, clip, path="idle/i.mp4")
        assert send_frames(h, segments, sid, clip, 0, 2).is_success
        deadline = time.monotonic() + 10
        while h.get(f"/v1/streams/{sid}").json()["state"] != "aborted":
            assert time.monotonic() < deadline, "the idle session was not aborted"
            time.sleep(0.01)  # often: a final state must already hold
        assert metric(h, 'framewire_stream_aborts_total{cause="idle"}') == 1
    assert not (w.outputs / "idle").exists()
    settle(w, baseline, keep=set(segments.keys))
    lines = [json.loads(line) for line in w.log.read_text().splitlines() if line.startswith("{")]
    assert any(r.get("stream_id") == sid and "idle" in r["message"] for r in lines)


def test_sigterm_gives_open_sessions_the_grace_then_aborts(workers, segments, tmp_path):
    w = workers.start("--shutdown-grace", "4")
    clip = make_clip(frames=6, height=48, width=64)
    with w.http() as h:
        finishing = open_stream(h, clip, path="finished.mp4")
        abandoned = open_stream(h, clip, path="abandoned.mp4")
        for sid in (finishing, abandoned):
            assert send_frames(h, segments, sid, clip, 0, 3).is_success
        w.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while w.fd_socket.exists():  # the drain has begun
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # New work is refused while the open sessions drain...
        r = h.post("/v1/streams", json={"path": "late.mp4", "fps": 24, "dtype": "float32",
                                        "height": 48, "width": 64})  # fmt: skip
        assert (r.status_code, r.json()["code"]) == (503, "shutting_down")
        # ...and a producer still sending finishes its file.
        assert send_frames(h, segments, finishing, clip, 3, 6).is_success
        assert h.post(f"/v1/streams/{finishing}/finish").status_code == 200
        stopping_at = time.monotonic()
    assert w.proc.wait(timeout=40) == 0
    assert 2 < time.monotonic() - stopping_at < 15  # the abandoned one had its grace
    assert sha256(w.outputs / "finished.mp4") == reference_mp4(clip, tmp_path / "ref.mp4")
    assert not (w.outputs / "abandoned.mp4").exists()
    assert framewire_temps(w.outputs) == []


def test_a_client_gone_mid_chunk_aborts_the_session(workers, segments):
    """The chunk (4.5 MiB as rgb24) is larger than what the pipe (1 MiB) and the slots
    the worker converts into ahead of its encoder (1.4 MiB here) hold, so its request is
    still being read when the client goes."""
    import socket

    w = workers.start(*WORKER_ARGS, "--stream-ahead-mib", "1")
    baseline = Baseline.of(w)
    clip = make_clip(frames=97, height=128, width=128)
    with w.http() as h:
        sid = open_stream(h, clip, path="gone.mp4")
        first = {"first_frame": 0, "source": segments.source(clip[:, :1].contiguous())}
        assert h.post(f"/v1/streams/{sid}/frames", json=first).is_success  # ffmpeg runs
    [ffmpeg] = wait_for_ffmpeg(w)
    os.kill(ffmpeg, signal.SIGSTOP)  # before the next chunk: it cannot all go in
    body = {"first_frame": 1, "source": segments.source(clip[:, 1:].contiguous())}
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(w.uds))
        sock.sendall(raw_http("POST", f"/v1/streams/{sid}/frames", body))
        wait_until_writes_stop(w.pid)  # the pump is blocked on the full pipe, mid-chunk
    # ...the client goes away.
    with w.http() as h:
        deadline = time.monotonic() + 10
        while h.get(f"/v1/streams/{sid}").json()["state"] != "aborted":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert metric(h, 'framewire_stream_aborts_total{cause="client"}') == 1
    assert not (w.outputs / "gone.mp4").exists()
    settle(w, baseline, keep=set(segments.keys))


def test_bad_open_requests_make_nothing(worker):
    before = set(worker.outputs.rglob("*"))
    base = {"path": "b/x.mp4", "fps": 24, "dtype": "float32", "height": 48, "width": 64}
    cases = [
        ({"fps": 0}, 400, "bad_fps"),
        ({"height": 0}, 400, "bad_request"),
        ({"dtype": "int32"}, 400, "bad_dtype"),
        ({"path": "../x.mp4"}, 403, "path_traversal"),
        ({"path": "x.png"}, 400, "unsupported_output_format"),
        ({"audio": "missing.wav"}, 404, "not_found"),
        ({"frames": 0}, 400, "bad_request"),
    ]
    with worker.http() as h:
        for over, status, code in cases:
            r = h.post("/v1/streams", json=base | over)
            assert (r.status_code, r.json()["code"]) == (status, code), (over, r.text)
    assert set(worker.outputs.rglob("*")) == before


def test_many_chunks_keep_the_worker_flat(worker, segments, tmp_path):
    """A long stream holds nothing per chunk: fds, children and memfds stay put."""
    baseline = Baseline.of(worker)
    clip = make_clip(frames=40, height=32, width=32)
    result = stream(worker, segments, clip, [1] * 40)
    assert result["sha256"] == reference_mp4(clip, tmp_path / "ref.mp4")
    (worker.outputs / "s.mp4").unlink()
    settle(worker, baseline, keep=set(segments.keys))


def test_a_sessions_encode_counts_as_in_flight_from_its_first_chunk_to_its_end(worker, segments):
    """framewire_encodes_in_flight is what a drain and a dashboard watch: a session's encoder
    runs from its first chunk's admission until the session ends, finished or deleted."""
    clip = make_clip(frames=4, height=48, width=64)
    with worker.http() as h:
        assert metric(h, "framewire_encodes_in_flight") == 0
        finished, deleted = open_stream(h, clip, path="f.mp4"), open_stream(h, clip, path="d.mp4")
        assert metric(h, "framewire_encodes_in_flight") == 0  # nothing sent: nothing runs
        for sid in (finished, deleted):
            assert send_frames(h, segments, sid, clip, 0, 2).status_code == 200
        assert metric(h, "framewire_encodes_in_flight") == 2
        assert send_frames(h, segments, finished, clip, 2, 4).status_code == 200
        assert h.post(f"/v1/streams/{finished}/finish").status_code == 200
        assert metric(h, "framewire_encodes_in_flight") == 1
        assert h.delete(f"/v1/streams/{deleted}").status_code == 204
        assert metric(h, "framewire_encodes_in_flight") == 0


class Posted:
    """``post()`` running on a thread: ``answer`` once it returned."""

    def __init__(self, post: Callable[[], Any]):
        self._answers: list[Any] = []
        self._thread = threading.Thread(target=lambda: self._answers.append(post()), daemon=True)
        self._thread.start()

    def answer(self, within: float) -> Any:
        """The response, or None if none came within ``within`` seconds."""
        self._thread.join(within)
        return self._answers[0] if self._answers else None


def answered_once_resumed(ffmpeg: int, post: Callable[[], Any]) -> None:
    """``post()`` (a chunk) is not answered while the stopped ``ffmpeg`` reads nothing;
    once it runs again (SIGCONT here), it is, 200."""
    posted = Posted(post)
    assert posted.answer(1.5) is None, "answered before ffmpeg's pipe took the chunk"
    os.kill(ffmpeg, signal.SIGCONT)
    assert posted.answer(30).status_code == 200


def test_a_chunk_is_answered_once_converted_not_once_encoded(workers, segments, tmp_path):
    """With ffmpeg stopped, a chunk that fits what the worker holds ahead (1 MiB and
    two slots) is answered at once, and its segment may be overwritten: the worker read
    it before answering. A chunk that does not fit waits for the encoder; the file is
    the encode of the frames as they were when each chunk was answered."""
    w = workers.start("--chunk-bytes", str(1 << 20), "--stream-ahead-mib", "1")
    clip = make_clip(frames=80, height=128, width=128)  # 48 KiB a frame as rgb24
    with w.http() as h:
        sid = open_stream(h, clip, path="ahead.mp4")
        assert send_frames(h, segments, sid, clip, 0, 1).status_code == 200  # ffmpeg runs
        [ffmpeg] = wait_for_ffmpeg(w)
        os.kill(ffmpeg, signal.SIGSTOP)
        try:
            # 30 frames, 1.4 MiB as rgb24: more than the pipe (1 MiB) holds, within what
            # the pipe and the slots hold together.
            key = segments.write(clip[:, 1:31].contiguous())
            body = {"first_frame": 1, "source": shm_source(key, clip[:, 1:31].contiguous())}
            r = Posted(lambda: h.post(f"/v1/streams/{sid}/frames", json=body)).answer(10)
            assert r is not None, "not answered while ffmpeg is stopped"
            assert r.status_code == 200 and r.json() == {"frames_received": 31}, r.text
            Path(f"/dev/shm{key}").write_bytes(bytes(len(raw_bytes(clip[:, 1:31]))))  # reused
            # 49 frames (2.3 MiB) cannot all be held: answered only once ffmpeg reads.
            with w.http() as h2:
                answered_once_resumed(ffmpeg, lambda: send_frames(h2, segments, sid, clip, 31, 80))
        finally:
            os.kill(ffmpeg, signal.SIGCONT)
        done = h.post(f"/v1/streams/{sid}/finish")
        assert done.status_code == 200, done.text
    assert done.json()["sha256"] == reference_mp4(clip, tmp_path / "ref.mp4")


def test_a_session_opened_without_ahead_answers_once_the_pipe_took_the_chunk(
    workers, segments, tmp_path
):
    """``"ahead": false`` (a whole clip sent chunk by chunk): with ffmpeg stopped, a chunk
    larger than the pipe is not answered until ffmpeg reads again."""
    w = workers.start("--chunk-bytes", str(1 << 20))
    clip = make_clip(frames=31, height=128, width=128)
    with w.http() as h:
        sid = open_stream(h, clip, path="paced.mp4", ahead=False)
        assert send_frames(h, segments, sid, clip, 0, 1).status_code == 200
        [ffmpeg] = wait_for_ffmpeg(w)
        os.kill(ffmpeg, signal.SIGSTOP)
        try:
            with w.http() as h2:
                answered_once_resumed(ffmpeg, lambda: send_frames(h2, segments, sid, clip, 1, 31))
        finally:
            os.kill(ffmpeg, signal.SIGCONT)
        done = h.post(f"/v1/streams/{sid}/finish")
    assert done.json()["sha256"] == reference_mp4(clip, tmp_path / "ref.mp4")


def test_a_paced_session_sends_rgb24_chunks_from_the_producers_pages(workers, segments, tmp_path):
    """``"ahead": false`` with rgb24 chunks (uint8 THWC) in shared memory: ffmpeg reads them
    from the producer's segment, so even a chunk the pipe could hold whole is answered only
    once ffmpeg has read every byte of it; the producer may overwrite it then."""
    w = workers.start("--chunk-bytes", str(1 << 20))
    thwc = Layout.THWC
    clip = make_clip(frames=12, height=128, width=128, dtype=torch.uint8, layout=thwc)
    with w.http() as h:
        sid = open_stream(h, clip, thwc, path="uncopied.mp4", ahead=False)
        first = frames_of(clip, thwc, 0, 1)
        body = {"first_frame": 0, "source": segments.source(first, thwc.value)}
        assert h.post(f"/v1/streams/{sid}/frames", json=body).status_code == 200
        [ffmpeg] = wait_for_ffmpeg(w)
        os.kill(ffmpeg, signal.SIGSTOP)
        try:
            part = frames_of(clip, thwc, 1, 12)  # 528 KiB: within the 1 MiB pipe
            key = segments.write(part)
            body = {"first_frame": 1, "source": shm_source(key, part, thwc.value)}
            with w.http() as h2:
                answered_once_resumed(
                    ffmpeg, lambda: h2.post(f"/v1/streams/{sid}/frames", json=body)
                )
            Path(f"/dev/shm{key}").write_bytes(bytes(len(raw_bytes(part))))  # reused
        finally:
            os.kill(ffmpeg, signal.SIGCONT)
        done = h.post(f"/v1/streams/{sid}/finish")
        assert done.status_code == 200, done.text
        assert metric(h, "framewire_stream_uncopied_bytes_total") == len(raw_bytes(clip))
    assert done.json()["sha256"] == reference_mp4(clip, tmp_path / "ref.mp4", layout=thwc)


def test_an_encoder_killed_after_a_chunk_was_answered_fails_the_finish(workers, segments):
    """The chunk went ahead of ffmpeg, which then died: the finish says so (422), no
    file is left, and the worker goes on."""
    w = workers.start("--chunk-bytes", str(1 << 20))
    baseline = Baseline.of(w)
    clip = make_clip(frames=40, height=128, width=128)
    with w.http() as h:
        sid = open_stream(h, clip, path="killed-after.mp4")
        assert send_frames(h, segments, sid, clip, 0, 1).status_code == 200
        [ffmpeg] = wait_for_ffmpeg(w)
        os.kill(ffmpeg, signal.SIGSTOP)
        assert send_frames(h, segments, sid, clip, 1, 40).status_code == 200  # held ahead
        os.kill(ffmpeg, signal.SIGKILL)
        r = h.post(f"/v1/streams/{sid}/finish")
        assert (r.status_code, r.json()["code"]) == (422, "ffmpeg_killed"), r.text
        assert h.get(f"/v1/streams/{sid}").json()["state"] == "failed"
    assert not (w.outputs / "killed-after.mp4").exists()
    settle(w, baseline, keep=set(segments.keys))


# A worker's fault of no known kind (a bug, an OSError nothing wrapped), in a session's
# chunk or in its finish: given to the worker through a sitecustomize of its own.
FAULTS = """
from framewire.service._stream import output

_feed, _finish = output.StreamOutput.feed, output.StreamOutput.finish


def feed(self, *args, **kwargs):
    if self.path.name == "fault-feed.mp4":
        raise RuntimeError("a fault of no known kind")
    return _feed(self, *args, **kwargs)


def finish(self, *args, **kwargs):
    if self.path.name == "fault-finish.mp4":
        raise RuntimeError("a fault of no known kind")
    return _finish(self, *args, **kwargs)


output.StreamOutput.feed, output.StreamOutput.finish = feed, finish
"""


def test_a_fault_of_no_known_kind_ends_the_session_and_frees_its_slot(workers, segments, tmp_path):
    """A chunk or a finish failing with an exception that is not framewire's answers 500
    ``internal`` and ends the session there: failed, its output gone, its CPU slot free
    for the next encode at once, not held until the session's idle bound."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAULTS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    # One slot, no small lane: a session still holding it makes the encode after it wait.
    w = workers.start("--cpu-slots", "1", "--small-encode-bytes", "0",
                      "--stream-idle-s", "600", env=env)  # fmt: skip
    baseline = Baseline.of(w)
    clip = make_clip(frames=4, height=48, width=64)
    with w.http() as h:
        for name in ("fault-feed.mp4", "fault-finish.mp4"):
            sid = open_stream(h, clip, path=name)
            r = send_frames(h, segments, sid, clip, 0, 4)
            if name == "fault-finish.mp4":
                assert r.status_code == 200, r.text
                r = h.post(f"/v1/streams/{sid}/finish")
            assert (r.status_code, r.json()["code"]) == (500, "internal"), r.text
            state = h.get(f"/v1/streams/{sid}").json()
            assert state["state"] == "failed" and state["error"]["code"] == "internal", state
            encode = {"outputs": [{"source": segments.source(clip), "path": "e.mp4", "fps": 24}]}
            r = h.post("/v1/videos:encode", json=encode, timeout=20)
            assert r.status_code == 200 and metric(h, "framewire_encodes_waiting") == 0, r.text
            (w.outputs / "e.mp4").unlink()
    assert sorted(p.name for p in w.outputs.iterdir()) == []
    settle(w, baseline, keep=set(segments.keys))
