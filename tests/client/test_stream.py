"""The stream writers against a real worker: the bytes, the staging pair, the ends.

``open_video`` promises a file byte-identical to ``save_video`` of the
concatenated frames; host chunks go through two staging segments however many
chunks there are; and a writer that does not close leaves nothing: no output,
no temp file, no shm segment, no session on the worker.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from framewire.client import (
    AsyncClient,
    AsyncVideoWriter,
    BadRequest,
    Client,
    OutputResult,
    Unavailable,
    VideoWriter,
)
from framewire.client import _session as stream_module

from tests.support.media import make_clip, reference_mp4, sha256
from tests.support.misbehaving import Fault, Misbehaving
from tests.support.processes import framewire_temps
from tests.support.requests import wait_for_ffmpeg
from tests.support.worker import Worker, metric

WORKER_ARGS = ("--stream-idle-s", "30")
HAS_CUDA = torch.cuda.is_available()


def our_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"framewire-{os.getpid()}-")}


def chunks(clip: torch.Tensor, size: int) -> list[torch.Tensor]:
    """CTHW ``clip`` cut along time into chunks of ``size`` frames (the last may be short)."""
    return list(torch.split(clip, size, dim=1))


def nothing_left(worker: Worker, name: str) -> None:
    assert not (worker.outputs / name).exists()
    assert framewire_temps(worker.outputs) == []
    assert our_segments() == set() and fd_regions(worker) == []
    with worker.http() as h:
        assert metric(h, "framewire_streams_open") == 0


class Counting:
    """Wraps the writer's staging (``Segment``, ``RegisteredMemfd``) to count what it makes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.made: list[int] = []
        for name in ("Segment", "RegisteredMemfd"):
            real = getattr(stream_module, name)

            def make(nbytes: int, *args: Any, real: Any = real) -> Any:
                self.made.append(nbytes)
                return real(nbytes, *args)

            monkeypatch.setattr(stream_module, name, make)


def fd_regions(worker: Worker) -> list[str]:
    with worker.http() as h:
        status = h.get("/v2/systemsharedmemory/status").json()
    return [r["key"] for r in status if r["key"].startswith("fd:")]


@pytest.mark.parametrize("route", ["fd", "shm"])
def test_a_written_video_is_the_bytes_of_save_video(worker, tmp_path, monkeypatch, route):
    clip = make_clip(frames=23, height=48, width=64, dtype=torch.float32)
    staging = Counting(monkeypatch)
    named = {} if route == "fd" else {"fd_socket": tmp_path / "nobody.sock"}
    with Client(worker.uds_url, **named) as c:
        with c.open_video("w.mp4", fps=23.976) as w:
            for part in chunks(clip, 3):
                w.write(part)
            # The staging pair, alive between chunks: regions of the worker, or segments.
            assert (len(fd_regions(worker)), len(our_segments())) == (
                (2, 0) if route == "fd" else (0, 2)
            )
        assert c.host_route == route
        assert isinstance(w.result, OutputResult)
        saved = c.save_video(clip, "s.mp4", fps=23.976)
    expected = reference_mp4(clip, tmp_path / "ref.mp4", fps=23.976)
    assert w.result.sha256 == saved.sha256 == expected == sha256(worker.outputs / "w.mp4")
    assert w.result.route == "stream" and w.result.frames == 23 == w.frames_sent
    # Eight chunks, two staging buffers of one chunk each: O(chunk), not O(clip).
    assert staging.made == [clip[:, :3].nbytes] * 2
    assert our_segments() == set() and fd_regions(worker) == []


def test_frames_received_follows_the_workers_answers(worker):
    """The count each chunk's answer carries: never ahead of what was sent, at least the
    chunk two back once ``write`` returns (it waited for that answer), all at the end."""
    clip = make_clip(frames=20, height=48, width=64)
    seen = []
    with Client(worker.uds_url) as c, c.open_video("counted.mp4", fps=24) as w:
        assert w.frames_received == 0
        for k, part in enumerate(chunks(clip, 2)):
            w.write(part)
            seen.append(w.frames_received)
            assert 2 * (k - 1) <= w.frames_received <= w.frames_sent == 2 * (k + 1)
    assert seen == sorted(seen)
    assert w.frames_received == 20 == w.frames_sent


def test_flush_waits_until_the_worker_read_every_chunk(worker):
    clip = make_clip(frames=12, height=48, width=64)
    with Client(worker.uds_url) as c, c.open_video("flushed.mp4", fps=24) as w:
        for part in chunks(clip, 4):
            w.write(part)
        w.flush()
        assert w.frames_received == w.frames_sent == 12

    async def go() -> None:
        async with AsyncClient(worker.uds_url) as c, c.open_video("flushed-async.mp4", fps=24) as w:
            for part in chunks(clip, 4):
                await w.write(part)
            await w.flush()
            assert w.frames_received == w.frames_sent == 12

    asyncio.run(go())


def test_a_writer_gives_up_on_a_silent_worker_within_its_bound(worker, tmp_path, monkeypatch):
    """A chunk the worker takes and never answers fails the writer after the client's
    bound (not sent again); the chunk queued behind it never leaves, and ending the
    session waits on its own short bound (the worker ends an idle session itself)."""
    monkeypatch.setattr(stream_module, "ABORT_TIMEOUT_S", 0.5)
    clip = make_clip(frames=12, height=48, width=64)
    silent = Fault("silent", r"POST /v1/streams/[^/]+/frames|DELETE /v1/streams/[^/]+")
    with Misbehaving(worker.uds, tmp_path, silent) as proxy:
        with Client(proxy.url, timeout=httpx.Timeout(1.0, connect=1.0), local_fallback=False) as c:
            started = time.monotonic()
            w = c.open_video("silent.mp4", fps=24)
            with pytest.raises(Unavailable, match="stream session is lost"):
                for part in chunks(clip, 4):
                    w.write(part)
                w.close()
            w.abort()
            waited = time.monotonic() - started
        # The chunk and the DELETE, each once: neither sent again, nor the queued chunk.
        assert proxy.hits == 2
    assert 1.5 <= waited < 3.0
    with worker.http() as http:  # the session the proxy kept the DELETE of
        assert http.delete(f"/v1/streams/{w.id}").status_code == 204
    assert not (worker.outputs / "silent.mp4").exists()


def test_numpy_thwc_chunks_of_uneven_sizes(worker, tmp_path):
    video = np.random.default_rng(5).integers(0, 256, (9, 17, 30, 3), np.uint8)
    with Client(worker.uds_url) as c, c.open_video("n.mp4", fps=24) as w:
        for a, b in [(0, 1), (1, 6), (6, 9)]:
            w.write(video[a:b])
    thwc = torch.from_numpy(video)
    assert w.result is not None
    assert w.result.sha256 == reference_mp4(thwc, tmp_path / "ref.mp4", layout="THWC")


@pytest.mark.parametrize("route", ["fd", "shm"])
def test_a_writer_at_the_encoders_pace_hands_rgb24_chunks_over_uncopied(worker, tmp_path, route):
    """``ahead=False``: uint8 THWC chunks reach the encoder from the writer's two buffers
    themselves, reused chunk after chunk (the worker counts every byte uncopied), and
    the bytes are save_video's; by default they are converted into the worker's staging."""
    video = np.random.default_rng(7).integers(0, 256, (30, 48, 64, 3), np.uint8)
    named = {} if route == "fd" else {"fd_socket": tmp_path / "nobody.sock"}
    counted = "framewire_stream_uncopied_bytes_total"
    with Client(worker.uds_url, **named) as c, worker.http() as h:
        before = metric(h, counted)
        with c.open_video("paced.mp4", fps=24, ahead=False) as paced:
            for t0 in range(0, 30, 4):
                paced.write(video[t0 : t0 + 4])
        assert c.host_route == route
        assert metric(h, counted) - before == video.nbytes
        with c.open_video("ahead.mp4", fps=24) as ahead:
            for t0 in range(0, 30, 4):
                ahead.write(video[t0 : t0 + 4])
        assert metric(h, counted) - before == video.nbytes
    expected = reference_mp4(torch.from_numpy(video), tmp_path / "ref.mp4", layout="THWC")
    assert paced.result is not None and ahead.result is not None
    assert paced.result.sha256 == ahead.result.sha256 == expected


def test_flush_of_a_count_waits_for_those_frames_alone(worker, tmp_path):
    """``flush(n)`` returns once the worker has read ``n`` frames, not every chunk: with
    ffmpeg stopped, a paced chunk larger than its pipe stays unread, and ``flush(1)``
    returns all the same; ``flush()`` returns once ffmpeg reads again."""
    video = np.random.default_rng(9).integers(0, 256, (41, 128, 128, 3), np.uint8)
    with Client(worker.uds_url) as c, c.open_video("counted.mp4", fps=24, ahead=False) as w:
        w.write(video[:1])
        w.flush()
        [ffmpeg] = wait_for_ffmpeg(worker)
        os.kill(ffmpeg, signal.SIGSTOP)
        try:
            w.write(video[1:])  # 1.9 MiB: more than the pipe holds
            started = time.monotonic()
            w.flush(1)
            assert time.monotonic() - started < 1 and w.frames_received == 1
            time.sleep(0.5)
            assert w.frames_received == 1, "read while ffmpeg was stopped"
        finally:
            os.kill(ffmpeg, signal.SIGCONT)
        w.flush()
        assert w.frames_received == 41
    expected = reference_mp4(torch.from_numpy(video), tmp_path / "ref.mp4", layout="THWC")
    assert w.result is not None and w.result.sha256 == expected


def test_an_exception_in_the_block_aborts_and_leaves_nothing(worker):
    clip = make_clip(frames=8, height=48, width=64)
    with (
        Client(worker.uds_url) as c,
        pytest.raises(RuntimeError, match="the VAE"),
        c.open_video("gone.mp4", fps=24) as w,
    ):
        w.write(clip[:, :4])
        raise RuntimeError("the VAE ran out of memory")
    assert w.result is None
    with worker.http() as h:
        assert h.get(f"/v1/streams/{w.id}").json()["state"] == "aborted"
    nothing_left(worker, "gone.mp4")


@pytest.mark.parametrize("route", ["fd", "shm"])
def test_a_first_chunk_that_cannot_be_copied_leaves_no_session(
    worker, monkeypatch, tmp_path, route
):
    """The first chunk is copied while the session opens: a copy that fails still learns
    the session's id, so the abort ends it (no session left to the idle bound)."""
    monkeypatch.setattr(stream_module.WriterBase, "_stage", _failing_copy)
    clip = make_clip(frames=4, height=48, width=64)
    named = {} if route == "fd" else {"fd_socket": tmp_path / "nobody.sock"}
    with (
        Client(worker.uds_url, **named) as c,
        pytest.raises(OSError, match="no memory"),
        c.open_video("uncopied.mp4", fps=24) as w,
    ):
        w.write(clip)
    assert w.id is not None
    with worker.http() as h:
        assert h.get(f"/v1/streams/{w.id}").json()["state"] == "aborted"
    nothing_left(worker, "uncopied.mp4")


def _failing_copy(self: Any, frames: Any, room: int = 0) -> Any:
    raise OSError(12, "no memory for a chunk buffer")


def test_a_refused_chunk_raises_its_error_and_leaves_nothing(worker):
    """A chunk's error comes back at the next call; the block then aborts."""
    first = make_clip(frames=2, height=48, width=64)
    wrong = make_clip(frames=2, height=32, width=64)
    with (
        Client(worker.uds_url) as c,
        pytest.raises(BadRequest) as caught,
        c.open_video("bad.mp4", fps=24) as w,
    ):
        w.write(first)
        w.write(wrong)  # refused on the sender thread: raised by a later call
        w.write(first)
    assert caught.value.code == "bad_shape"
    nothing_left(worker, "bad.mp4")


def test_closing_a_writer_that_wrote_nothing_is_refused(worker):
    with Client(worker.uds_url) as c:
        w = c.open_video("empty.mp4", fps=24)
        with pytest.raises(ValueError, match="no frames"):
            w.close()
        w.abort()  # safe after anything
    nothing_left(worker, "empty.mp4")


def test_the_async_writer_gives_the_same_bytes(worker, tmp_path):
    clip = make_clip(frames=10, height=48, width=64, dtype=torch.bfloat16)

    async def go() -> OutputResult:
        async with AsyncClient(worker.uds_url) as c:
            async with c.open_video("a.mp4", fps=24) as w:
                for part in chunks(clip, 4):
                    await w.write(part)
            assert w.result is not None and w.frames_received == 10
            return w.result

    result = asyncio.run(go())
    assert result.sha256 == reference_mp4(clip, tmp_path / "ref.mp4")
    assert our_segments() == set()


def test_the_async_writer_aborts_on_an_exception(worker):
    clip = make_clip(frames=6, height=48, width=64)

    async def go() -> AsyncVideoWriter:
        async with AsyncClient(worker.uds_url) as c:
            w = c.open_video("agone.mp4", fps=24)
            with pytest.raises(KeyError):
                async with w:
                    await w.write(clip[:, :3])
                    await w.write(clip[:, 3:])
                    raise KeyError("cancelled by the user")
            return w

    w = asyncio.run(go())
    assert w.result is None
    nothing_left(worker, "agone.mp4")


def test_a_cancelled_async_writer_is_cancelled_and_leaves_nothing(worker):
    """A task cancelled while its writer waits on a chunk's answer ends cancelled: the
    CancelledError goes on up, never kept as the writer's error, and the session is
    aborted."""
    clip = make_clip(frames=6, height=48, width=64)

    async def go() -> AsyncVideoWriter:
        async with AsyncClient(worker.uds_url) as c:
            w = c.open_video("cancelled.mp4", fps=24)
            await w.write(clip[:, :3])
            answer, real = asyncio.Event(), w._send_chunk

            async def held(call: Any) -> Any:
                await answer.wait()  # the worker's answer to the next chunk, held back
                return await real(call)

            w._send_chunk = held  # type: ignore[method-assign]
            await w.write(clip[:, 3:])
            closing = asyncio.create_task(w.close())
            await asyncio.sleep(0.3)
            assert not closing.done()  # waiting on the held chunk
            closing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await closing
            assert closing.cancelled()
            return w

    w = asyncio.run(go())
    assert w.result is None
    nothing_left(worker, "cancelled.mp4")


def writer_api(cls: type) -> dict[str, Any]:
    return {n: f for n, f in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}


def test_the_writers_are_twins():
    sync, coro = writer_api(VideoWriter), writer_api(AsyncVideoWriter)
    assert sorted(sync) == sorted(coro) == ["abort", "close", "flush", "write"]
    for name in sync:
        assert inspect.iscoroutinefunction(coro[name]) and not inspect.iscoroutinefunction(
            sync[name]
        ), name
        assert inspect.getdoc(sync[name]) == inspect.getdoc(coro[name]), name


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU: torch.cuda.is_available() is False")
def test_cuda_chunks_give_the_bytes_of_save_video(worker, tmp_path: Path):
    clip = make_clip(frames=12, height=48, width=64, dtype=torch.bfloat16)
    with Client(worker.uds_url) as c, c.open_video("g.mp4", fps=24) as w:
        for part in chunks(clip.cuda(), 5):
            w.write(part)
    assert w.result is not None
    assert w.result.sha256 == reference_mp4(clip, tmp_path / "ref.mp4")
