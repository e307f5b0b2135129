"""A save of host frames over the whole-clip bound goes as stream sessions, chunk by chunk:
the caller never holds a copy of the clip, the bytes are the whole clip's, and a failed
output leaves the others complete, as one encode request's would. (The bounds are made
small here: the suite's clips are.)"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch
from framewire.client import AsyncClient, BadRequest, Client
from framewire.client import _chunked as chunked_module
from framewire.client import _session as session_module

from tests.client.test_stream import Counting
from tests.support.media import make_clip, reference_mp4, sha256
from tests.support.worker import metric

CHUNK = 1 << 20


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(chunked_module, "CHUNK_BYTES", CHUNK)
    monkeypatch.setattr(chunked_module, "WHOLE_BYTES", 2 * CHUNK)


def counters(worker) -> tuple[float, float]:
    """The worker's stream chunks read, and its encode requests answered."""
    with worker.http() as h:
        text = h.get("/metrics").text
        chunks = metric(h, "framewire_stream_chunks_total")
    encodes = sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
        if line.startswith('framewire_requests_total{route="/v1/videos:encode"')
    )  # fmt: skip
    return chunks, encodes


def test_a_clip_over_two_chunks_goes_chunk_by_chunk_with_the_whole_clips_bytes(
    worker, tmp_path, monkeypatch
):
    clip = make_clip(frames=13, height=128, width=160)  # 3.2 MB: over two chunks of 1 MiB
    assert clip.nbytes > 2 * CHUNK
    staging = Counting(monkeypatch)
    chunks_before, encodes_before = counters(worker)
    asked: list[bool] = []  # each session's "ahead": the frames all exist, none is asked
    real = session_module.StreamOpen.model_validate

    def noting(fields: dict) -> object:
        asked.append(fields["ahead"])
        return real(fields)

    monkeypatch.setattr(session_module.StreamOpen, "model_validate", noting)
    with Client(worker.uds_url) as c:
        [result] = c.save_videos([clip], ["chunked.mp4"], fps=24)
        per_chunk = CHUNK // clip[:, 0].nbytes  # frames of one chunk
        assert staging.made == [clip[:, :per_chunk].nbytes] * 2  # two chunks, never the clip
        chunks, encodes = counters(worker)
        with c.open_video("producer.mp4", fps=24) as writer:  # a producer's stream: ahead
            writer.write(clip[:, :2])
    assert asked == [False, True]
    # The first chunk's first frame goes alone (client/_stream.py first_frame): one more.
    assert chunks - chunks_before == -(-13 // per_chunk) + 1 and encodes == encodes_before
    assert result.ok and result.frames == 13 and result.route == "stream"
    assert result.sha256 == sha256(worker.outputs / "chunked.mp4")
    assert result.sha256 == reference_mp4(clip, tmp_path / "ref.mp4")


def test_a_small_clip_still_goes_whole_in_one_request(worker, monkeypatch):
    clip = make_clip(frames=4, height=48, width=64)
    staging = Counting(monkeypatch)
    _, encodes_before = counters(worker)
    with Client(worker.uds_url) as c:
        c.save_video(clip, "whole.mp4", fps=24)
    assert staging.made == [] and counters(worker)[1] == encodes_before + 1


def test_several_outputs_side_by_side_and_a_refused_one_leaves_the_others(worker, tmp_path):
    """THWC uint8 numpy and CTHW float: each output its own session, a chunk of each in
    turn; one refused (its audio's rate) fails alone, with every output's result on the
    error."""
    floats = make_clip(frames=14, height=128, width=160)
    frames = (np.random.default_rng(3).random((40, 128, 160, 3)) * 255).astype(np.uint8)
    with Client(worker.uds_url) as c:
        ok = c.save_videos([floats, frames], ["a.mp4", "b.mp4"], fps=24)
        assert [r.ok for r in ok] == [True, True] and [r.frames for r in ok] == [14, 40]
        bad_audio = [None, np.zeros((2400, 1), np.float32)]
        with pytest.raises(BadRequest) as refused:
            c.save_videos([floats, frames], ["c.mp4", "d.mp4"], fps=24, audio=bad_audio,
                          audio_sample_rate=1000)  # fmt: skip
    assert ok[0].sha256 == reference_mp4(floats, tmp_path / "a.mp4")
    results = refused.value.results
    assert [r.ok for r in results] == [True, False] and results[1].error.code == "bad_sample_rate"
    assert (worker.outputs / "c.mp4").exists() and not (worker.outputs / "d.mp4").exists()


def test_the_async_twin_goes_chunk_by_chunk_too(worker, tmp_path, monkeypatch):
    clip = torch.from_numpy(make_clip(frames=13, height=128, width=160).numpy().copy())
    staging = Counting(monkeypatch)

    async def go():
        async with AsyncClient(worker.uds_url) as c:
            return await c.save_video(clip, "async.mp4", fps=24)

    result = asyncio.run(go())
    assert len(staging.made) == 2
    assert result.sha256 == reference_mp4(clip, tmp_path / "ref.mp4")


def test_outputs_the_worker_admits_one_at_a_time_both_complete(workers, tmp_path):
    """One CPU slot: the worker admits the second output's encode only once the first is
    done. Written a chunk of each in turn, the save would wait on the second output's
    answers until a session's idle bound (5 s here); it takes what each output allows."""
    w = workers.start("--cpu-slots", "1", "--stream-idle-s", "5")
    clips = [make_clip(frames=16, height=128, width=160, seed=s) for s in (1, 2)]
    started = time.monotonic()
    with Client(w.uds_url) as c:
        results = c.save_videos(clips, ["one.mp4", "two.mp4"], fps=24, threads=1)
    assert time.monotonic() - started < 5
    for clip, result in zip(clips, results, strict=True):
        assert result.sha256 == reference_mp4(clip, tmp_path / "ref.mp4", threads=1)


def test_a_worker_older_than_ahead_still_takes_a_chunked_save(worker, tmp_path):
    """A worker that does not know ``"ahead"`` refuses the body naming it (400): the save
    opens its session again without it, and the file is the whole clip's; a producer's
    stream never names it (its default), so such a worker takes it at once."""
    from tests.support.misbehaving import Fault, Misbehaving

    clip = make_clip(frames=13, height=128, width=160)
    older = Fault("older", r"POST /v1/streams", fields=("ahead",))
    with Misbehaving(worker.uds, tmp_path, older) as proxy, Client(proxy.url) as c:
        [result] = c.save_videos([clip], ["older.mp4"], fps=24)
        assert proxy.refused == 1
        with c.open_video("older-stream.mp4", fps=24) as writer:
            writer.write(clip[:, :2])
        assert proxy.refused == 1
    assert result.ok and result.route == "stream"
    assert result.sha256 == reference_mp4(clip, tmp_path / "ref.mp4")


def test_a_lone_output_waits_on_its_answers_without_polling(worker, tmp_path, monkeypatch):
    """One output waits on its own chunks' answers: a poll's sleep was up to 5 ms of its
    end. (Side by side, outputs poll so that none holds up another: the test above.)"""
    slept: list[float] = []
    real_sleep = time.sleep

    def noting(seconds: float) -> None:
        slept.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(chunked_module.time, "sleep", noting)
    clip = make_clip(frames=26, height=128, width=160)  # 7 chunks of 4 frames
    with Client(worker.uds_url) as c:
        [alone] = c.save_videos([clip], ["alone.mp4"], fps=24)
    assert slept == []
    assert alone.ok and alone.sha256 == reference_mp4(clip, tmp_path / "ref.mp4")
