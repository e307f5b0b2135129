"""Engine profiles and audio from memory through a real worker: client, HTTP, both routes.

The bytes are checked against the engines' own steps (tests/support/engines.py);
every wrong request gets its 4xx code and leaves nothing behind.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
from framewire.client import BadRequest, Client

from tests.service.encode.test_profiles import waveform
from tests.support.engines import sglang_save, vllm_omni_quantize, vllm_omni_save
from tests.support.http import http_client
from tests.support.media import make_clip, reference_mp4, sha256
from tests.support.worker import Worker

NO_FD = "/nonexistent/fd.sock"  # a named fd socket nobody serves: host memory goes as shm


def client(worker: Worker, route: str) -> Client:
    return Client(worker.uds_url, fd_socket=worker.fd_socket if route == "fd" else NO_FD)


@pytest.mark.parametrize("route", ["fd", "shm"])
def test_sglang_medium_quality_with_audio_from_memory(worker, tmp_path, route):
    clip = make_clip(12, 30, 34)
    audio = torch.from_numpy(waveform(12000, 2))
    want = sglang_save(clip, tmp_path / "s.mp4", fps=23.976, output_compression=55,
                       audio=audio.numpy(), sample_rate=24000)  # fmt: skip
    with client(worker, route) as c:
        result = c.save_video(clip, f"sglang-{route}.mp4", fps=23.976, quality=5.5,
                              profile="sglang", audio=audio, audio_sample_rate=24000)  # fmt: skip
        assert c.host_route == route
    assert result.ok and result.audio is not None
    assert result.sha256 == sha256(worker.outputs / f"sglang-{route}.mp4") == want
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"framewire-{os.getpid()}-")]


def test_imageio_profile_with_audio_from_memory_is_the_wav_route(worker, tmp_path):
    import scipy.io.wavfile

    clip = make_clip(12, 32, 32)
    audio = waveform(12000, 1)
    wav = tmp_path / "a.wav"
    scipy.io.wavfile.write(wav, 24000, np.clip(audio, -1, 1))
    with Client(worker.uds_url) as c:
        result = c.save_video(clip, "imageio-audio.mp4", fps=24, audio=audio[:, 0],
                              audio_sample_rate=24000)  # fmt: skip
    assert result.sha256 == reference_mp4(clip, tmp_path / "ref.mp4", audio=wav)


@pytest.mark.parametrize("height", [32, 192])  # 192: x264's slice and frame counts part
def test_vllm_omni_stream_session(worker, tmp_path, height):
    clip = make_clip(10, height, 48) * 2 - 1
    want = vllm_omni_save(vllm_omni_quantize(clip, (-1.0, 1.0)), tmp_path / "v.mp4", fps=16)
    with Client(worker.uds_url) as c, c.open_video("vllm.mp4", fps=16, profile="vllm-omni",
                                                   value_range=(-1.0, 1.0)) as writer:  # fmt: skip
        for t0 in range(0, 10, 4):
            writer.write(clip[:, t0 : t0 + 4])
    assert writer.result is not None and writer.result.sha256 == want


def test_fractional_quality_over_http(worker, tmp_path):
    clip = make_clip(4)
    with Client(worker.uds_url) as c:
        result = c.save_video(clip, "q.mp4", fps=24, quality=7.5)
    assert result.sha256 == reference_mp4(clip, tmp_path / "ref.mp4", quality=7.5)  # type: ignore[arg-type]


def audio_source(segments, samples: np.ndarray, **over: object) -> dict[str, object]:
    key = segments.write(samples.tobytes())
    body = {"kind": "shm", "key": key, "dtype": samples.dtype.name, "shape": list(samples.shape),
            "sample_rate": 24000, "byte_size": samples.nbytes}  # fmt: skip
    return body | over


def tiny_video(segments) -> dict[str, object]:
    return segments.source(torch.zeros((2, 16, 16, 3), dtype=torch.uint8), "THWC")


@pytest.mark.parametrize(
    ("over", "code"),
    [
        ({"sample_rate": 7999}, "bad_sample_rate"),
        ({"sample_rate": 192001}, "bad_sample_rate"),
        ({"shape": [100, 9], "byte_size": 3600}, "bad_audio_channels"),
        ({"byte_size": 404}, "byte_size_mismatch"),
        ({"shape": [40_000_000, 2], "byte_size": 320_000_000}, "audio_too_large"),
        ({"dtype": "float64"}, "bad_audio_dtype"),
        ({"nan": True}, "audio_not_finite"),
        ({"key": "/framewire-test-missing"}, "shm_not_found"),
    ],
)
def test_bad_audio_is_refused_with_its_code(worker, segments, over, code):
    samples = waveform(100, 1)
    if over.pop("nan", False):
        samples[7, 0] = np.nan
    body = {"outputs": [{"source": tiny_video(segments), "path": "bad-audio.mp4", "fps": 24,
                         "audio": audio_source(segments, samples, **over)}]}  # fmt: skip
    with worker.http() as h:
        r = h.post("/v1/videos:encode", json=body)
        assert (r.status_code, r.json()["code"]) in ((400, code), (404, code)), r.text
        assert h.get("/healthz").status_code == 200
    assert not (worker.outputs / "bad-audio.mp4").exists()
    assert not [p for p in worker.outputs.iterdir() if p.name.startswith(".framewire-tmp")]


def encode_requests(worker: Worker) -> float:
    """The encode requests the worker has answered, whatever their status."""
    with worker.http() as h:
        text = h.get("/metrics").text
    mine = re.findall(r'^framewire_requests_total\{route="/v1/videos:encode"[^}]*\} (\S+)$',
                      text, re.MULTILINE)  # fmt: skip
    return sum(float(v) for v in mine)


@pytest.mark.parametrize(
    ("options", "code"),
    [
        ({"quality": 10.5}, "bad_quality"),
        ({"quality": -0.1}, "bad_quality"),
        ({"profile": "ffmpeg"}, "bad_profile"),
        ({"value_range": [0, 1]}, "bad_value_range"),
        ({"profile": "vllm-omni", "value_range": [1, -1]}, "bad_value_range"),
        ({"profile": "diffusers", "audio": "tone.wav"}, "audio_unsupported"),
        ({"profile": "vllm-omni", "audio": "tone.wav"}, "audio_unsupported"),
    ],
)
def test_profile_options_are_checked_by_client_and_worker(worker, segments, options, code):
    frames = np.zeros((2, 16, 16, 3), np.uint8)
    sent = encode_requests(worker)
    with Client(worker.uds_url) as c, pytest.raises(BadRequest) as err:
        c.save_video(frames, "opts.mp4", fps=24, **options)  # type: ignore[arg-type]
    assert err.value.code == code
    assert encode_requests(worker) == sent  # the client's own check: nothing was sent
    body = {"outputs": [{"source": tiny_video(segments), "path": "opts.mp4", "fps": 24, **options}]}
    with http_client(worker.tcp_url) as h:
        r = h.post("/v1/videos:encode", json=body)
    assert (r.status_code, r.json()["code"]) == (400, code), r.text


def test_odd_sizes_under_vllm_omni_are_refused_over_http(worker):
    with Client(worker.uds_url) as c, pytest.raises(BadRequest) as err:
        c.save_video(make_clip(2, 31, 32), "odd.mp4", fps=24, profile="vllm-omni")
    assert err.value.code == "odd_size"
    assert not (worker.outputs / "odd.mp4").exists()


def test_info_names_the_profiles_and_the_pyav_build(worker):
    import av

    with worker.http() as h:
        info = h.get("/v1/info").json()
    assert info["profiles"] == ["imageio", "sglang", "diffusers", "vllm-omni"]
    assert info["pyav"]["version"] == av.__version__


@pytest.mark.parametrize(
    ("options", "audio_rate", "code"),
    [
        ({"profile": "sglang", "fps": 0.001}, None, "bad_fps"),  # SGLang writes "-r 0.00"
        ({"profile": "sglang", "fps": 0.004}, None, "bad_fps"),
        ({"profile": "vllm-omni", "fps": 24}, 8001, "bad_sample_rate"),  # AAC cannot open
        ({"profile": "vllm-omni", "fps": 24}, 192000, "bad_sample_rate"),
    ],
)
def test_rates_the_engine_cannot_write_are_bad_input(worker, segments, options, audio_rate, code):
    """Refused before anything runs (the engine would fail), not a 422 from the encoder."""
    audio = None
    if audio_rate is not None:
        audio = audio_source(segments, waveform(1000, 1), sample_rate=audio_rate)
    output = {"source": tiny_video(segments), "path": "rate.mp4", **options}
    stream = {"path": "rate.mp4", "dtype": "uint8", "layout": "THWC", "height": 16,
              "width": 16, **options}  # fmt: skip
    if audio is not None:
        output["audio"] = stream["audio"] = audio
    with worker.http() as h:
        for route, body in (("/v1/videos:encode", {"outputs": [output]}), ("/v1/streams", stream)):
            r = h.post(route, json=body)
            assert (r.status_code, r.json()["code"]) == (400, code), (route, r.text)
    samples = None if audio_rate is None else waveform(1000, 1)
    with Client(worker.uds_url) as c, pytest.raises(BadRequest) as err:
        c.save_video(np.zeros((2, 16, 16, 3), np.uint8), "rate.mp4", **options,
                     audio=samples, audio_sample_rate=audio_rate)  # fmt: skip
    assert err.value.code == code
    assert not (worker.outputs / "rate.mp4").exists()


def test_the_aac_rates_are_pyavs():
    import av
    from framewire.core.wire._audio import AAC_SAMPLE_RATES, MAX_SAMPLE_RATE, MIN_SAMPLE_RATE

    rates = av.Codec("aac", "w").audio_rates
    assert rates is not None
    assert sorted(r for r in rates if MIN_SAMPLE_RATE <= r <= MAX_SAMPLE_RATE) == list(
        AAC_SAMPLE_RATES
    )
