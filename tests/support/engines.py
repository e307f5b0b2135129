"""Oracles for the engine profiles: each engine's save steps as its source writes them.

Written here from the engines' code, not from framewire's, and pinned to the
versions verified (docs/engines.md). diffusers installs light, so its real
``export_to_video`` is called instead of an oracle.

- SGLang 0.5.23, ``runtime/entrypoints/utils.py``: ``_sample_to_uint8_frames``,
  ``_normalize_audio_to_numpy``, the WAV from ``scipy.io.wavfile.write``, and
  the argv of ``_save_video_ffmpeg`` (the CPU path) or ``_cuda_video_ffmpeg_command``.
- vLLM-omni 0.30.0: ``diffusion/utils/chunked_video.quantize_chunk`` and
  ``diffusion/utils/media_utils.mux_video_audio_bytes``.
"""

from __future__ import annotations

import io
import itertools
import os
import subprocess
import tempfile
from collections.abc import Iterable
from fractions import Fraction
from pathlib import Path
from types import ModuleType
from typing import Any

import av
import numpy as np
import scipy.io.wavfile
import torch

from tests.support.media import FFMPEG, sha256
from tests.support.zygote import start_variables

SGLANG_VERSION, DIFFUSERS_VERSION, VLLM_OMNI_VERSION = "0.5.23", "0.42.1", "0.30.0"


def sglang_frames(sample: torch.Tensor) -> list[np.ndarray]:
    """``_sample_to_uint8_frames`` of a (3, T, H, W) tensor: [H, W, 3] uint8 frames."""
    frames = (sample * 255).clamp(0, 255).to(torch.uint8).permute(1, 2, 3, 0).contiguous()
    return list(frames.numpy())


def sglang_audio(audio: torch.Tensor | np.ndarray) -> np.ndarray:
    """``_normalize_audio_to_numpy``: float32 clamped to [-1, 1], (samples, channels)."""
    if isinstance(audio, torch.Tensor):
        out = audio.detach().float().clamp(-1.0, 1.0).cpu().numpy()
    else:
        out = np.clip(audio.astype(np.float32, copy=False), -1.0, 1.0)
    if out.ndim == 2 and out.shape[0] < out.shape[1]:
        out = out.T
    return out


def sglang_save(
    sample: torch.Tensor,
    path: Path,
    *,
    fps: float,
    output_compression: int | None = None,
    x264_preset: str | None = None,
    audio: np.ndarray | None = None,
    sample_rate: int = 24000,
    cuda_command: bool = False,
    ffmpeg: str = FFMPEG,
) -> str:
    """SGLang's save of one video (and its audio) with ``ffmpeg``; returns the sha256."""
    quality = output_compression / 10 if output_compression is not None else 5
    frames = sglang_frames(sample)
    height, width = frames[0].shape[:2]
    with tempfile.TemporaryDirectory() as tmp:
        wav = None
        if audio is not None:
            wav = os.path.join(tmp, "audio.wav")
            scipy.io.wavfile.write(wav, sample_rate, sglang_audio(audio))
        cmd = [ffmpeg, "-y", "-f", "rawvideo", "-vcodec", "rawvideo", "-s", f"{width}x{height}"]
        cmd += ["-pix_fmt", "rgb24", "-r", f"{fps:.02f}", "-i", "pipe:0"]
        cmd += ["-an"] if wav is None else ["-i", wav]
        if wav is not None and not cuda_command:
            cmd += ["-acodec", "aac"]
        cmd += ["-vcodec", "libx264", "-preset", x264_preset or "fast", "-pix_fmt", "yuv420p"]
        cmd += ["-crf", str(int((1 - quality / 10.0) * 51))]
        if width % 16 or height % 16:
            cmd += ["-vf", f"scale={(width + 15) // 16 * 16}:{(height + 15) // 16 * 16}"]
        if cuda_command:
            cpu = len(os.sched_getaffinity(0))
            threads = min(max(1, cpu * 3 // 2), max(1, max(1, (height + 15) // 16) // 2), 128)
            cmd += ["-threads", str(threads)]
            if wav is not None:
                cmd += ["-acodec", "aac", "-map", "0:v:0", "-map", "1:a:0"]
            cmd += ["-v", "warning"]
        cmd.append(str(path))
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdin is not None
        for frame in frames:
            proc.stdin.write(memoryview(np.ascontiguousarray(frame)))
        _, err = proc.communicate()
        assert proc.returncode == 0, err.decode(errors="replace")
    return sha256(path)


def vllm_omni_quantize(chunk: torch.Tensor, value_range: tuple[float, float]) -> np.ndarray:
    """``quantize_chunk`` of a (3, T, H, W) chunk: (T, H, W, 3) uint8."""
    low, high = float(value_range[0]), float(value_range[1])
    scale = 255.0 / (high - low)
    frames = chunk.clamp(low, high).sub(low).mul(scale).round().to(torch.uint8)
    return frames.permute(1, 2, 3, 0).contiguous().numpy()


def vllm_omni_save(
    frames: np.ndarray,
    path: Path,
    *,
    fps: float,
    crf: str = "18",
    options: dict[str, str] | None = None,
    audio: np.ndarray | None = None,
    sample_rate: int = 44100,
) -> str:
    """``mux_video_audio_bytes`` of (T, H, W, 3) uint8 frames, written to ``path``."""
    if options is None:
        options = {"preset": "ultrafast", "threads": "0"}  # its serving default
    buf = io.BytesIO()
    container = av.open(buf, mode="w", format="mp4")
    v_stream = container.add_stream("h264", rate=Fraction(fps).limit_denominator(10000))
    v_stream.width, v_stream.height = frames.shape[2], frames.shape[1]
    v_stream.pix_fmt = "yuv420p"
    merged = {"crf": str(crf)}
    merged.update(options)
    v_stream.options = merged
    a_stream = None
    if audio is not None:
        samples = audio.astype(np.float32)
        if samples.ndim == 1:
            samples = samples[None, :]
        elif samples.shape[0] > samples.shape[1]:
            samples = np.ascontiguousarray(samples.T)
        layout = "stereo" if samples.shape[0] >= 2 else "mono"
        a_stream = container.add_stream("aac", rate=sample_rate)
        a_stream.layout = layout
    _mux_all(container, v_stream, (av.VideoFrame.from_ndarray(f, format="rgb24") for f in frames))
    if a_stream is not None:
        frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout=layout)
        frame.sample_rate, frame.pts, frame.time_base = sample_rate, 0, Fraction(1, sample_rate)
        _mux_all(container, a_stream, [frame])
    container.close()
    path.write_bytes(buf.getvalue())
    return sha256(path)


def _mux_all(container: Any, stream: Any, frames: Iterable[Any]) -> None:
    """Every packet of each frame as it is encoded, then those the flush at the end gives
    (``encode(None)``), in the order the engine muxes them."""
    for frame in itertools.chain(frames, [None]):
        for packet in stream.encode(frame):
            container.mux(packet)


def diffusers_export_utils() -> ModuleType:
    """diffusers' ``export_utils``, imported where it is first needed (1.6 s of CPU: not
    in the collection of every one of the suite's processes). The import sets torch's
    TORCHINDUCTOR_CACHE_DIR, which is taken back out of os.environ: with it, every later
    worker of this process would start afresh rather than fork (tests/support/zygote.py)."""
    before = start_variables()
    import diffusers.utils.export_utils

    for name in start_variables().keys() - before.keys():
        del os.environ[name]
    return diffusers.utils.export_utils


def diffusers_save(frames: np.ndarray | list[np.ndarray], path: Path, *, fps: int) -> str:
    """diffusers' own ``export_to_video`` (installed ``--no-deps``); returns the sha256."""
    diffusers_export_utils().export_to_video(list(frames), str(path), fps=fps)
    return sha256(path)
