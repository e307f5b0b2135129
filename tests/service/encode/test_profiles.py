"""Each engine profile byte-exact with that engine's own save path (tests/support/engines.py).

Frames go through the worker's encoder with small chunks (several per clip), on
the stream route and on the fallback, against each engine's steps on the
same frames: every dtype the engine takes, odd sizes, 23.976 fps, values out of
range, fractional qualities, and audio from memory.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from framewire.client.wire import AudioDType, Layout, ShmAudio
from framewire.core.errors import BadRequest
from framewire.core.media.argv import x264_auto_threads
from framewire.service._encode.encoder import EncodeParams, Encoder
from framewire.service._encode.profiles import PYAV_CHILD
from framewire.service._sources.audio import MemoryAudio, samples_of, wav_header
from framewire.service._sources.frames import TensorSource
from PIL import Image

from tests.support.engines import (
    diffusers_save,
    sglang_save,
    vllm_omni_quantize,
    vllm_omni_save,
)
from tests.support.media import make_clip, with_specials

CHUNK = 3 * 30 * 34 * 6  # a few frames a chunk: every clip spans several


class _NoStream(Encoder):
    """The stream route fails at once: every output is redone on the fallback."""

    def _stream(self, *args: object, **kw: object) -> None:
        raise OSError("injected: the fast path is unavailable")


ENCODERS = {"stream": Encoder(chunk_bytes=CHUNK), "fallback": _NoStream(chunk_bytes=CHUNK)}


def encode(route: str, clip: torch.Tensor, path: Path, **params: object) -> str:
    layout = params.pop("layout", Layout.CTHW)
    result = ENCODERS[route].encode(
        TensorSource(clip, layout),  # type: ignore[arg-type]
        path,
        EncodeParams(**params),  # type: ignore[arg-type]
    )
    assert result.route == route
    return result.sha256


def waveform(samples: int = 9000, channels: int = 2, seed: int = 0) -> np.ndarray:
    """(samples, channels) float32 with some samples beyond [-1, 1] (SGLang clamps them)."""
    t = np.arange(samples, dtype=np.float32)[:, None] / 24000
    tone = 0.8 * np.sin(2 * np.pi * (220 + 110 * np.arange(channels)) * t)
    noise = np.random.default_rng(seed).normal(0, 0.2, (samples, channels))
    return (tone + noise).astype(np.float32) * 1.3


def memory_audio(samples: np.ndarray, rate: int, *, clamp: bool) -> MemoryAudio:
    dtype = AudioDType(samples.dtype.name)
    src = ShmAudio(
        key="/unused",
        dtype=dtype,
        shape=list(samples.shape),
        sample_rate=rate,
        byte_size=samples.nbytes,
    )
    return MemoryAudio(src, samples_of(samples.tobytes(), src, clamp=clamp))


# --- SGLang ---------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["stream", "fallback"])
@pytest.mark.parametrize(
    ("dtype", "fps", "compression", "size"),
    [
        (torch.float32, 24, None, (34, 30)),  # default quality, a size scaled up to 48x32
        (torch.bfloat16, 23.976, 55, (32, 32)),  # "medium": quality 5.5, -r 23.98
        (torch.float16, 30, 35, (34, 30)),  # "low"
        (torch.float32, 12.5, 90, (32, 48)),  # "high"
    ],
)
def test_sglang_profile(tmp_path, route, dtype, fps, compression, size):
    width, height = size
    clip = with_specials(make_clip(7, height, width, dtype=dtype))
    want = sglang_save(clip, tmp_path / "sglang.mp4", fps=fps, output_compression=compression)
    quality = None if compression is None else compression / 10
    got = encode(route, clip, tmp_path / "fw.mp4", fps=fps, quality=quality, profile="sglang")
    assert got == want


def test_sglang_cuda_command_gives_the_cpu_paths_bytes(tmp_path):
    clip = make_clip(5, 30, 34)
    cpu = sglang_save(clip, tmp_path / "cpu.mp4", fps=24, output_compression=55)
    cuda = sglang_save(
        clip, tmp_path / "cuda.mp4", fps=24, output_compression=55, cuda_command=True
    )
    assert cpu == cuda == encode("stream", clip, tmp_path / "fw.mp4", fps=24, quality=5.5,
                                 profile="sglang")  # fmt: skip


@pytest.mark.parametrize("route", ["stream", "fallback"])
@pytest.mark.parametrize(("channels", "rate"), [(2, 24000), (1, 48000)])
def test_sglang_audio_from_memory(tmp_path, route, channels, rate):
    clip = make_clip(12, 32, 32)
    audio = waveform(rate // 2, channels)
    want = sglang_save(clip, tmp_path / "sglang.mp4", fps=24, audio=audio, sample_rate=rate)
    with memory_audio(audio, rate, clamp=True) as wav:
        got = encode(route, clip, tmp_path / "fw.mp4", fps=24, profile="sglang", audio=wav)
    assert got == want


def test_the_wav_is_scipys(tmp_path):
    import scipy.io.wavfile

    for samples in (waveform(1001, 3), (waveform(500, 2) * 20000).astype(np.int16)):
        path = tmp_path / "scipy.wav"
        scipy.io.wavfile.write(path, 32000, samples)
        with memory_audio(samples, 32000, clamp=False) as wav:
            ours = os.pread(wav.fd, 1 << 20, 0)
        assert ours == path.read_bytes()
        assert ours.startswith(wav_header(AudioDType(samples.dtype.name), samples.shape[1],
                                          32000, samples.shape[0]))  # fmt: skip


def test_nan_samples_are_refused():
    samples = waveform(100, 1)
    samples[50, 0] = np.nan
    with pytest.raises(BadRequest) as err:
        memory_audio(samples, 24000, clamp=True)
    assert err.value.code == "audio_not_finite"


# --- diffusers ------------------------------------------------------------------------------


def diffusers_frames(clip: torch.Tensor) -> list[np.ndarray]:
    """A pipeline's ``output_type="np"`` frames: float32 (T, H, W, 3) whatever the dtype
    (diffusers' ``VaeImageProcessor.pt_to_numpy`` calls ``.float()``)."""
    return list(clip.float().permute(1, 2, 3, 0).contiguous().numpy())


@pytest.mark.parametrize("route", ["stream", "fallback"])
@pytest.mark.parametrize(
    ("dtype", "fps", "size"),
    [
        (torch.float32, 16, (34, 30)),
        (torch.float16, 24, (32, 32)),
        (torch.bfloat16, 23.976, (34, 30)),
    ],
)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # diffusers' own, on the wrapped values
def test_diffusers_profile_wraps_out_of_range_values_as_diffusers_does(
    tmp_path, route, dtype, fps, size
):
    width, height = size
    clip = with_specials(make_clip(7, height, width, dtype=dtype))
    clip[0, 1:3] = clip[0, 1:3] * 1.6 - 0.3  # whole frames out of [0, 1]: they wrap
    want = diffusers_save(diffusers_frames(clip), tmp_path / "diffusers.mp4", fps=fps)
    got = encode(route, clip, tmp_path / "fw.mp4", fps=fps, profile="diffusers")
    assert got == want


def test_diffusers_profile_uint8_is_its_pil_route(tmp_path):
    clip = make_clip(6, 30, 34, dtype=torch.uint8, layout=Layout.THWC)
    want = diffusers_save([Image.fromarray(f) for f in clip.numpy()], tmp_path / "d.mp4", fps=8)
    got = encode("stream", clip, tmp_path / "fw.mp4", fps=8, profile="diffusers",
                 layout=Layout.THWC)  # fmt: skip
    assert got == want


# --- vLLM-omni ------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["stream", "fallback"])
@pytest.mark.parametrize(
    ("dtype", "value_range", "fps"),
    [
        (torch.float32, (-1.0, 1.0), 16),  # Wan
        (torch.bfloat16, (-1.0, 1.0), 23.976),
        (torch.float16, (0.0, 1.0), 24),  # MiniMax-H3
    ],
)
def test_vllm_omni_profile(tmp_path, route, dtype, value_range, fps):
    clip = make_clip(9, 32, 48, dtype=torch.float32)
    if value_range == (-1.0, 1.0):
        clip = clip * 2 - 1
    clip = with_specials(clip * 1.1).to(dtype)  # some values beyond the range: clamped
    want = vllm_omni_save(vllm_omni_quantize(clip, value_range), tmp_path / "v.mp4", fps=fps)
    got = encode(route, clip, tmp_path / "fw.mp4", fps=fps, profile="vllm-omni",
                 value_range=value_range)  # fmt: skip
    assert got == want


@pytest.mark.parametrize("route", ["stream", "fallback"])
@pytest.mark.parametrize("height", [192, 256])
def test_vllm_omni_default_threads_are_the_engines(tmp_path, route, height):
    """No ``threads`` asked for: vLLM-omni passes "0" (x264's slice-thread count), not
    the frame-thread count x264_auto_threads gives ffmpeg; at these heights they part."""
    clip = make_clip(5, height, 64) * 2 - 1
    want = vllm_omni_save(vllm_omni_quantize(clip, (-1.0, 1.0)), tmp_path / "v.mp4", fps=24)
    # The count x264 wrote into the engine's file (its SEI) is not the frame-thread one.
    written = re.search(rb" threads=(\d+) ", (tmp_path / "v.mp4").read_bytes())
    assert written is not None and int(written[1]) != x264_auto_threads(height)
    got = encode(route, clip, tmp_path / "fw.mp4", fps=24, profile="vllm-omni",
                 value_range=(-1.0, 1.0))  # fmt: skip
    assert got == want


def test_vllm_omni_audio_is_muxed_unclamped(tmp_path):
    clip = make_clip(12, 32, 32) * 2 - 1
    audio = waveform(16000, 2)
    frames = vllm_omni_quantize(clip, (-1.0, 1.0))
    want = vllm_omni_save(frames, tmp_path / "v.mp4", fps=24, audio=audio, sample_rate=32000)
    with memory_audio(audio, 32000, clamp=False) as wav:
        got = encode("stream", clip, tmp_path / "fw.mp4", fps=24, profile="vllm-omni", audio=wav)
    assert got == want


def test_vllm_omni_pinned_threads_and_quality(tmp_path):
    clip = make_clip(6, 32, 32) * 2 - 1
    frames = vllm_omni_quantize(clip, (-1.0, 1.0))
    want = vllm_omni_save(frames, tmp_path / "v.mp4", fps=24, crf="25",
                          options={"preset": "fast", "threads": "2"})  # fmt: skip
    got = encode("stream", clip, tmp_path / "fw.mp4", fps=24, profile="vllm-omni",
                 quality=5, preset="fast", threads=2)  # fmt: skip
    assert got == want


def test_vllm_omni_odd_sizes_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(BadRequest) as err:
        encode("stream", make_clip(3, 31, 32), tmp_path / "odd.mp4", fps=24, profile="vllm-omni")
    assert err.value.code == "odd_size"
    assert list(tmp_path.iterdir()) == []


def test_rates_the_engine_cannot_write_are_refused_in_process_too(tmp_path):
    """The worker's own check, for the local encoder and CLI (no wire model before it)."""
    with pytest.raises(BadRequest) as err:
        encode("stream", make_clip(2, 16, 16), tmp_path / "s.mp4", fps=0.004, profile="sglang")
    assert err.value.code == "bad_fps"
    with memory_audio(waveform(1000, 1), 8000, clamp=False) as wav:
        wav.source = wav.source.model_copy(update={"sample_rate": 8001})
        with pytest.raises(BadRequest) as err:
            encode("stream", make_clip(2, 16, 16), tmp_path / "v.mp4", fps=24,
                   profile="vllm-omni", audio=wav)  # fmt: skip
    assert err.value.code == "bad_sample_rate"
    assert list(tmp_path.iterdir()) == []


def test_the_pyav_child_starts_on_pyav_alone():
    """The vllm-omni profile's child, run as the worker runs it, imports nothing of
    framewire's (through the packages, ``-m``, it imported the client and took three
    times the CPU to start), nor numpy (its import was 0.03-0.04 of the 0.11-0.14
    CPU-s each child's start took: benchmarks/spare_start.py): paid on every encode."""
    ran = subprocess.run(
        [*PYAV_CHILD, "--help"],
        env=os.environ | {"PYTHONPROFILEIMPORTTIME": "1"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ran.returncode == 0 and "usage: pyav_writer" in ran.stdout, ran.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in ran.stderr.splitlines()}
    assert "av" in imported
    assert "numpy" not in imported
    assert [m for m in imported if m.startswith("framewire")] == []


@pytest.mark.parametrize(("height", "width"), [(32, 50), (1100, 50), (48, 854)])
def test_frames_with_padded_rows_are_read_row_by_row_into_the_engines_bytes(
    tmp_path: Path, height: int, width: int
) -> None:
    """Where PyAV pads an rgb24 frame's rows (854 wide, a 480p clip's: 2592 bytes a row
    for 2562), each row is read into its place; past the kernel's 1024 buffers a read
    (1100 rows) the rows go in several. The bytes are the engine's."""
    assert av.VideoFrame(width, height, "rgb24").planes[0].line_size != width * 3
    frames = vllm_omni_quantize(make_clip(3, height, width) * 2 - 1, (-1.0, 1.0))
    want = vllm_omni_save(frames, tmp_path / "v.mp4", fps=24)
    out = tmp_path / "fw.mp4"
    argv = ["--size", f"{width}x{height}", "--rate", "24/1", "--crf", "18", "--preset",
            "ultrafast", "--threads", "0", str(out)]  # fmt: skip
    ran = subprocess.run([*PYAV_CHILD, *argv], input=frames.tobytes(), capture_output=True,
                         timeout=60)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert hashlib.sha256(out.read_bytes()).hexdigest() == want


def test_an_audio_input_shorter_than_its_header_fails_the_child(tmp_path: Path) -> None:
    """The samples are read before any frame is encoded: a short read fails the encode
    at once, said on stderr."""
    fd = os.memfd_create("short-audio")
    try:
        os.write(fd, bytes(4 * 100))  # 100 float32 samples, where 2 x 1000 are announced
        out = tmp_path / "v.mp4"
        argv = ["--size", "64x48", "--rate", "24/1", "--crf", "18", "--threads", "1",
                "--audio", f"{fd},0,1000,2,16000", str(out)]  # fmt: skip
        frames = bytes(2 * 64 * 48 * 3)
        ran = subprocess.run([*PYAV_CHILD, *argv], input=frames, capture_output=True,
                             pass_fds=[fd], timeout=60)  # fmt: skip
    finally:
        os.close(fd)
    assert ran.returncode != 0
    assert b"the audio input is shorter than its header says" in ran.stderr


def test_the_pyav_child_exits_without_tearing_the_interpreter_down(tmp_path: Path) -> None:
    """Once its output is closed the child leaves at once: the interpreter's teardown
    (PyAV's and numpy's modules) cost every encode about 40 ms before the worker saw it
    exit. A ``sitecustomize`` of the test's notes whether the teardown ran; ``--help``,
    which leaves through ``SystemExit``, shows that it would see it."""
    marker = tmp_path / "torn-down"
    (tmp_path / "sitecustomize.py").write_text(
        f"import atexit\natexit.register(open, {str(marker)!r}, 'w')\n"
    )
    env = os.environ | {"PYTHONPATH": str(tmp_path)}
    shown = subprocess.run([*PYAV_CHILD, "--help"], env=env, capture_output=True, timeout=60)
    assert shown.returncode == 0 and marker.exists(), shown.stderr
    marker.unlink()
    out = tmp_path / "v.mp4"
    frames = np.zeros((2, 48, 64, 3), np.uint8).tobytes()
    argv = ["--size", "64x48", "--rate", "24/1", "--crf", "18", "--threads", "1", str(out)]
    ran = subprocess.run(
        [*PYAV_CHILD, *argv], input=frames, env=env, capture_output=True, timeout=60
    )
    assert ran.returncode == 0, ran.stderr
    assert out.stat().st_size > 0
    assert not marker.exists()


@pytest.mark.parametrize("channels", [1, 2])
def test_an_audio_job_gives_the_engines_bytes_without_numpy(tmp_path: Path, channels: int) -> None:
    """The waveform is read and made PyAV's planar frame without numpy (its import, a
    third of the child's start, was on the path of every audio encode): the frame
    ``from_ndarray`` makes of the engine's array, the same bytes, mono and stereo."""
    audio = waveform(8000, channels)
    frames = vllm_omni_quantize(make_clip(6, 32, 48) * 2 - 1, (-1.0, 1.0))
    want = vllm_omni_save(frames, tmp_path / "v.mp4", fps=24, audio=audio, sample_rate=16000)
    fd = os.memfd_create("audio")
    try:
        os.write(fd, np.ascontiguousarray(audio, np.float32).tobytes())  # (samples, channels)
        out = tmp_path / "fw.mp4"
        argv = ["--size", "48x32", "--rate", "24/1", "--crf", "18", "--preset", "ultrafast",
                "--threads", "0", "--audio", f"{fd},0,{len(audio)},{channels},16000",
                str(out)]  # fmt: skip
        ran = subprocess.run([*PYAV_CHILD, *argv], input=frames.tobytes(), capture_output=True,
                             pass_fds=[fd], env=os.environ | {"PYTHONPROFILEIMPORTTIME": "1"},
                             timeout=60)  # fmt: skip
    finally:
        os.close(fd)
    assert ran.returncode == 0, ran.stderr
    imported = {line.rsplit(b"|", 1)[-1].strip() for line in ran.stderr.splitlines()}
    assert b"av" in imported and b"numpy" not in imported
    assert hashlib.sha256(out.read_bytes()).hexdigest() == want


def test_the_pyav_child_converts_in_a_thread_ahead_of_the_encoder(tmp_path: Path) -> None:
    """The rgb24 -> yuv420p conversion runs in a thread of its own beside x264 (a
    ``sitecustomize`` notes each thread the child starts), at a size where swscale's
    slices and x264's threads both come into play, and the bytes stay the engine's."""
    started = tmp_path / "threads"
    (tmp_path / "sitecustomize.py").write_text(
        "import threading\n"
        "_start = threading.Thread.start\n"
        "def start(self):\n"
        f"    open({str(started)!r}, 'a').write(self.name + '\\n')\n"
        "    _start(self)\n"
        "threading.Thread.start = start\n"
    )
    frames = vllm_omni_quantize(make_clip(4, 480, 832) * 2 - 1, (-1.0, 1.0))
    want = vllm_omni_save(frames, tmp_path / "v.mp4", fps=24)
    out = tmp_path / "fw.mp4"
    argv = ["--size", "832x480", "--rate", "24/1", "--crf", "18", "--preset", "ultrafast",
            "--threads", "0", str(out)]  # fmt: skip
    ran = subprocess.run([*PYAV_CHILD, *argv], input=frames.tobytes(), capture_output=True,
                         env=os.environ | {"PYTHONPATH": str(tmp_path)}, timeout=60)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert "convert" in started.read_text().split()
    assert hashlib.sha256(out.read_bytes()).hexdigest() == want


def test_input_that_ends_inside_a_frame_fails_the_child_through_its_converter(
    tmp_path: Path,
) -> None:
    """A short read in the converting thread is the encode's failure, said on stderr."""
    out = tmp_path / "v.mp4"
    argv = ["--size", "64x48", "--rate", "24/1", "--crf", "18", "--threads", "1", str(out)]
    partial = bytes(64 * 48 * 3 + 100)  # one frame and a piece of the next
    ran = subprocess.run([*PYAV_CHILD, *argv], input=partial, capture_output=True, timeout=60)
    assert ran.returncode != 0
    assert b"input ended inside a frame (100 of 9216 bytes)" in ran.stderr


@pytest.mark.parametrize(("height", "width"), [(480, 832), (768, 1344), (34, 50)])
def test_swscale_threads_do_not_change_a_pixel(height: int, width: int) -> None:
    """The child converts on one swscale thread where PyAV's own encode would use its
    codec's count: the same pixels either way, or the engine's bytes would part."""
    from av.video.reformatter import VideoReformatter

    rgb = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
    pixels = {
        VideoReformatter().reformat(frame, width, height, "yuv420p", threads=n).to_ndarray()
        .tobytes()
        for n in (0, 1, 2, 4)
    }  # fmt: skip
    assert len(pixels) == 1
