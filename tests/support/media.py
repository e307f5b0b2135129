"""Float clips like a VAE's, and the reference encode every byte-exact test compares with."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import imageio.v2 as imageio
import imageio_ffmpeg
import numpy as np
import torch
from framewire.client.wire import Layout

FFMPEG = imageio_ffmpeg.get_ffmpeg_exe()


def sha256(path: str | os.PathLike[str]) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def decoded_frames(path: str | os.PathLike[str]) -> bytes:
    """The video's frames as ffmpeg decodes them, rgb24, one for each frame the file holds
    (none dropped or repeated): two files that show the same pictures give the same bytes."""
    return subprocess.run(
        [FFMPEG, "-v", "error", "-i", str(path), "-map", "0:v:0", "-fps_mode", "passthrough",
         "-f", "rawvideo", "-pix_fmt", "rgb24", "-"],
        check=True, capture_output=True,
    ).stdout  # fmt: skip


def make_clip(
    frames: int = 6,
    height: int = 48,
    width: int = 64,
    dtype: torch.dtype = torch.float32,
    layout: Layout = Layout.CTHW,
    seed: int = 0,
) -> torch.Tensor:
    """A deterministic float clip in [0, 1] (or uint8) with structure and noise."""
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(0, 1, frames).view(1, frames, 1, 1)
    y = torch.linspace(0, 1, height).view(1, 1, height, 1)
    x = torch.linspace(0, 1, width).view(1, 1, 1, width)
    c = torch.tensor([0.2, 0.5, 0.8]).view(3, 1, 1, 1)
    # 0.5 + 0.35 sin(6x + 4y + 3t + 5c), plus noise, clamped: the same operations in the
    # same order as written out, in place in one clip-sized tensor (and one of noise),
    # not a new one for each step (big clips are most of the suite's own CPU time).
    clip = torch.add(6 * x + 4 * y + 3 * t, c * 5, out=torch.empty(3, frames, height, width))
    clip.sin_().mul_(0.35).add_(0.5)
    clip.add_(torch.rand(3, frames, height, width, generator=g).mul_(0.08)).clamp_(0, 1)
    clip = clip.mul_(255).to(torch.uint8) if dtype == torch.uint8 else clip.to(dtype)
    if layout is Layout.TCHW:
        clip = clip.permute(1, 0, 2, 3)
    elif layout is Layout.THWC:
        clip = clip.permute(1, 2, 3, 0)
    return clip.contiguous()


def reference_uint8(clip: torch.Tensor | np.ndarray, layout: Layout) -> np.ndarray:
    """The in-process conversion, written out here independently of framewire's code."""
    x = torch.from_numpy(clip) if isinstance(clip, np.ndarray) else clip
    if x.dtype != torch.uint8:
        x = (x * 255).clamp_(0, 255).to(torch.uint8)
    perm = {Layout.CTHW: (1, 2, 3, 0), Layout.TCHW: (0, 2, 3, 1), Layout.THWC: (0, 1, 2, 3)}
    return x.permute(*perm[layout]).contiguous().numpy()


def reference_mp4(
    clip: torch.Tensor | np.ndarray,
    path: Path,
    *,
    layout: Layout = Layout.CTHW,
    fps: float = 24,
    quality: int = 5,
    preset: str = "fast",
    threads: int | None = None,
    audio: Path | None = None,
) -> str:
    """The oracle: imageio.mimsave as docs/byte-exactness.md states it. Returns its sha256.

    The same frames and arguments give the same file, which a test process asks for
    again and again (one clip through several routes and fixtures): it is encoded once
    and written from memory after that (small files only)."""
    frames = reference_uint8(clip, layout)
    key = (hashlib.sha256(frames).hexdigest(), frames.shape, fps, quality, preset, threads,
           None if audio is None else sha256(audio),
           os.environ.get("IMAGEIO_FFMPEG_EXE"))  # fmt: skip
    if (known := _ENCODED.get(key)) is not None:
        Path(path).write_bytes(known)
        return hashlib.sha256(known).hexdigest()
    output_params = ["-preset", preset]
    if threads is not None:
        output_params += ["-threads", str(threads)]
    kwargs: dict[str, object] = {}
    if audio is not None:
        kwargs = {"audio_path": str(audio), "audio_codec": "aac"}
    imageio.mimsave(
        str(path),
        list(frames),
        fps=fps,
        codec="libx264",
        quality=quality,
        output_params=output_params,
        **kwargs,
    )
    encoded = Path(path).read_bytes()
    if len(encoded) <= _ENCODED_MAX_BYTES and len(_ENCODED) < _ENCODED_MAX:
        _ENCODED[key] = encoded
    return hashlib.sha256(encoded).hexdigest()


_ENCODED: dict[tuple[object, ...], bytes] = {}  # reference_mp4's files, by what made them
_ENCODED_MAX, _ENCODED_MAX_BYTES = 512, 1 << 20


# Values whose bytes the conversion must get right: NaN, infinities, signed zero, out of
# range, and a rounding step either side of the truncation points.
SPECIALS = [
    float("nan"),
    float("inf"),
    -float("inf"),
    -0.5,
    -0.0,
    1.0,
    1.5,
    0.999999,
    0.5 / 255,
    254.5 / 255,
    1e-8,
    3e38,
]


def around(centres: torch.Tensor) -> torch.Tensor:
    """float32 ``centres`` (where a conversion's byte flips), each also one and two ulps
    either side, then the special values."""
    values = [centres]
    for direction in (float("inf"), -float("inf")):
        step = centres
        for _ in range(2):
            step = torch.nextafter(step, torch.full_like(step, direction))
            values.append(step)
    values.append(torch.tensor(SPECIALS, dtype=torch.float32))
    return torch.cat(values)


def with_specials(clip: torch.Tensor) -> torch.Tensor:
    flat = clip.clone().view(-1)
    specials = torch.tensor(SPECIALS, dtype=torch.float32).to(clip.dtype)
    flat[: len(specials)] = specials
    flat[-len(specials) :] = specials
    return flat.view(clip.shape)
