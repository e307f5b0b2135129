"""Audio from memory through a real worker: one copy per distinct audio, and a budget.

Stream sessions and outputs that name the same samples share one WAV in the
worker (one memfd, whatever their number); distinct audio is counted against
``FRAMEWIRE_AUDIO_BUDGET_BYTES`` and refused past it until some is let go.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from tests.service.encode.test_profiles import waveform
from tests.service.stream.test_sessions import open_stream, open_streams, send_frames
from tests.support.engines import sglang_save, vllm_omni_quantize, vllm_omni_save
from tests.support.identity import NOBODY, as_nobody
from tests.support.media import make_clip
from tests.support.real import needs_root
from tests.support.requests import encode_body
from tests.support.segments import Segments
from tests.support.worker import Worker

# 6 frames at 24 fps: 0.25 s, and as much audio (ffmpeg's muxing of audio much longer
# than the video is not the same run to run, the engine's own command's included).
SAMPLES = 6000  # float32 mono at 24 kHz: 24000 bytes
BUDGET = 60000  # two distinct audios held (2 x 24058), a third one would pass it


@pytest.fixture
def audio_worker(workers) -> Worker:
    return workers.start("--audio-budget-bytes", str(BUDGET), "--cpu-slots", "2")


def audio_memfds(worker: Worker) -> int:
    return sum(f.startswith("/memfd:framewire-audio") for f in worker.open_fds())


def memory_audio(segments: Segments, samples: np.ndarray, rate: int = 24000) -> dict[str, Any]:
    return {"kind": "shm", "key": segments.write(samples.tobytes()), "dtype": "float32",
            "shape": list(samples.shape), "sample_rate": rate,
            "byte_size": samples.nbytes}  # fmt: skip


def test_sessions_share_one_copy_and_distinct_audio_is_budgeted(audio_worker, segments, tmp_path):
    w = audio_worker
    clip = make_clip(frames=6, height=32, width=32)
    one = waveform(SAMPLES, 1, seed=1)
    shared = memory_audio(segments, one)
    with w.http() as h:
        # Six sessions name the same samples (each from its own segment: the content is
        # what counts): one WAV in the worker.
        same = [memory_audio(segments, one) for _ in range(5)] + [shared]
        sids = [open_stream(h, clip, path=f"a{i}.mp4", profile="sglang", audio=a)
                for i, a in enumerate(same)]  # fmt: skip
        assert audio_memfds(w) == 1
        # Another audio: a second WAV. A third distinct one would pass the budget.
        other = open_stream(h, clip, path="b.mp4", profile="sglang",
                            audio=memory_audio(segments, waveform(SAMPLES, 1, seed=2)))  # fmt: skip
        assert audio_memfds(w) == 2
        third = memory_audio(segments, waveform(SAMPLES, 1, seed=3))
        body = {"path": "c.mp4", "fps": 24, "dtype": "float32", "height": 32, "width": 32,
                "profile": "sglang", "audio": third}  # fmt: skip
        r = h.post("/v1/streams", json=body)
        assert (r.status_code, r.json()["code"]) == (429, "audio_budget_full"), r.text
        assert "retry-after" in r.headers
        encode = encode_body(segments.source(clip), "c.mp4", profile="sglang", audio=third)
        r = h.post("/v1/videos:encode", json=encode)
        assert (r.status_code, r.json()["code"]) == (429, "audio_budget_full"), r.text
        # The same audio again is no new copy: still taken.
        again = open_stream(h, clip, path="a-again.mp4", profile="sglang", audio=shared)
        assert h.delete(f"/v1/streams/{again}").status_code == 204
        # Letting the other audio go makes room.
        assert h.delete(f"/v1/streams/{other}").status_code == 204
        assert audio_memfds(w) == 1
        r = h.post("/v1/streams", json=body)
        assert r.status_code == 201, r.text
        assert h.delete(f"/v1/streams/{r.json()['id']}").status_code == 204
        # Two sessions sharing the WAV finish with SGLang's bytes; the rest are aborted.
        want = sglang_save(clip, tmp_path / "ref.mp4", fps=24, output_compression=50,
                           audio=one, sample_rate=24000)  # fmt: skip
        for sid in sids[:2]:
            assert send_frames(h, segments, sid, clip, 0, 6).status_code == 200
            r = h.post(f"/v1/streams/{sid}/finish")
            assert r.status_code == 200, r.text
            assert r.json()["sha256"] == want
        for sid in sids[2:]:
            assert h.delete(f"/v1/streams/{sid}").status_code == 204
    for name in ("a0.mp4", "a1.mp4"):
        (w.outputs / name).unlink()


def test_audio_larger_than_the_budget_is_a_400(audio_worker, segments):
    big = memory_audio(segments, np.zeros((BUDGET // 4 + 1, 1), np.float32))
    clip = make_clip(frames=2, height=16, width=16)
    with audio_worker.http() as h:
        r = h.post("/v1/videos:encode", json=encode_body(segments.source(clip), "big.mp4",
                                                         profile="sglang", audio=big))  # fmt: skip
    assert (r.status_code, r.json()["code"]) == (400, "audio_too_large"), r.text


def test_outputs_sharing_audio_encode_at_once_byte_exact(audio_worker, segments, tmp_path):
    """Four vllm-omni outputs of one request mux one WAV, two at a time (two CPU slots):
    the PyAV children read it without sharing a file position."""
    clip = make_clip(frames=4, height=32, width=32) * 2 - 1
    audio = waveform(8000, 1)
    source = memory_audio(segments, audio, rate=48000)
    outputs = [{"source": segments.source(clip), "path": f"v{i}.mp4", "fps": 24,
                "profile": "vllm-omni", "audio": source} for i in range(4)]  # fmt: skip
    with audio_worker.http() as h:
        r = h.post("/v1/videos:encode", json={"outputs": outputs})
        assert r.status_code == 200, r.text
    frames = vllm_omni_quantize(clip, (-1.0, 1.0))
    want = vllm_omni_save(frames, tmp_path / "v.mp4", fps=24, audio=audio, sample_rate=48000)
    assert [o["sha256"] for o in r.json()["outputs"]] == [want] * 4
    assert audio_memfds(audio_worker) == 0
    for i in range(4):
        (audio_worker.outputs / f"v{i}.mp4").unlink()


def test_the_copy_goes_with_the_last_user(audio_worker, segments):
    clip = make_clip(frames=2, height=16, width=16)
    samples = waveform(1000, 1)
    with audio_worker.http() as h:
        sids = [open_stream(h, clip, path=f"l{i}.mp4", profile="sglang",
                            audio=memory_audio(segments, samples)) for i in range(3)]  # fmt: skip
        for sid in sids:
            assert audio_memfds(audio_worker) == 1
            assert h.delete(f"/v1/streams/{sid}").status_code == 204
    assert audio_memfds(audio_worker) == 0


@needs_root
def test_one_caller_holds_its_share_of_the_budget_and_the_ranks_the_rest(workers, segments):
    w = workers.start("--audio-budget-bytes", str(BUDGET),
                      "--allowed-uids", f"{os.getuid()},{NOBODY}")  # fmt: skip
    w.outputs.chmod(0o777)
    body = {"fps": 24, "dtype": "float32", "height": 32, "width": 32, "profile": "sglang"}
    # Half the budget is one caller's: one WAV of 24058 bytes fits in it, a second does not.
    bodies = [body | {"path": f"n{i}.mp4", "audio": memory_audio(segments, waveform(SAMPLES, 1,
              seed=10 + i))} for i in range(2)]  # fmt: skip
    theirs = as_nobody(open_streams, w.tcp_url, bodies)
    assert isinstance(theirs, list), theirs
    got = [(status, answer.get("code")) for status, answer in theirs]
    assert got == [(201, None), (429, "user_share")], got
    clip = make_clip(frames=6, height=32, width=32)
    with w.http() as h:  # the worker's own uid (the ranks) still has the rest
        mine = open_stream(h, clip, path="r.mp4", profile="sglang",
                           audio=memory_audio(segments, waveform(SAMPLES, 1, seed=20)))  # fmt: skip
        assert audio_memfds(w) == 2
        for sid in [mine, theirs[0][1]["id"]]:
            assert h.delete(f"/v1/streams/{sid}").status_code == 204
    assert audio_memfds(w) == 0
