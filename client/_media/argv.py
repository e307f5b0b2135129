"""The ffmpeg command lines of the byte-exact contracts, in exactly one place.

Both the worker's fast paths and the reference/fallback paths build their argv
here, and the tests compare these against what imageio-ffmpeg runs. Any change
to a single token can change output bytes, so nothing else in the project may
spell these commands out.
"""

from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path

MACRO_BLOCK = 16

# What ffmpeg may open for each input, passed before its ``-i`` (``guard=True``).
# Demuxers that follow references to other files (hls, dash, concat, image2,
# ffmetadata, imf, ...) are left out: a file under the input roots must not be
# able to make ffmpeg read anything else. None of these changes an output byte.
VIDEO_DEMUXERS = "mov,matroska,avi,flv,mpegts,mpeg,gif,h264,hevc,m4v,ivf,ogg,asf,nut,yuv4mpegpipe"
AUDIO_DEMUXERS = "wav,w64,mp3,flac,ogg,aac,mov,matroska,aiff,caf"
PIPE_GUARD = ("-protocol_whitelist", "pipe,fd")  # "-" and pipe:N (ffmpeg 7+ calls "-" fd:)
VIDEO_FILE_GUARD = ("-protocol_whitelist", "file", "-format_whitelist", VIDEO_DEMUXERS)
AUDIO_FILE_GUARD = ("-protocol_whitelist", "file", "-format_whitelist", AUDIO_DEMUXERS)
GUARD_OPTIONS = frozenset({"-protocol_whitelist", "-format_whitelist"})

# Extensions whose muxer writes exactly one file. Segmenting muxers (hls, dash,
# segment), image sequences and patterns would write files the worker never
# names: refused up front.
OUTPUT_EXTENSIONS = (".mp4", ".m4v", ".mov", ".mkv")


def refused_input(stderr: str) -> bool:
    """Whether ffmpeg's stderr says an input was refused by its whitelists."""
    return "not on whitelist" in stderr


def unguarded(argv: list[str]) -> list[str]:
    """``argv`` without the whitelist options: the command as the engines spell it."""
    out: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
        elif token in GUARD_OPTIONS:
            skip = True
        else:
            out.append(token)
    return out


def fps_arg(fps: float | Fraction) -> str:
    """The ``-r`` value imageio-ffmpeg passes: an exact rational (23.976 -> 2997/125)."""
    if not isinstance(fps, Fraction):
        fps = Fraction(fps).limit_denominator()
    return str(fps)


def crf_for_quality(quality: float) -> int:
    """imageio's 1..10 quality scale mapped to x264's CRF, float arithmetic included."""
    return int((1 - quality / 10.0) * 51)


def padded_size(width: int, height: int) -> tuple[int, int]:
    """Each side rounded up to the next multiple of 16, as imageio's writer scales."""

    def up(v: int) -> int:
        return v + (MACRO_BLOCK - v % MACRO_BLOCK) % MACRO_BLOCK

    return up(width), up(height)


def cpu_count() -> int:
    return len(os.sched_getaffinity(0))


def x264_auto_threads(height: int, cpus: int | None = None) -> int:
    """x264's own frame-thread choice for this height on this many CPUs.

    Passing it explicitly gives the same bytes as letting x264 choose, and lets
    the scheduler know what an encode will cost.
    """
    cpus = cpu_count() if cpus is None else cpus
    return min(cpus * 3 // 2, max(1, ((height + 15) // 16) // 2), 128)


def encode_argv(
    ffmpeg: str,
    *,
    width: int,
    height: int,
    fps: float | Fraction,
    output: str | os.PathLike[str],
    quality: float = 5,
    preset: str = "fast",
    threads: int | None = None,
    audio: str | os.PathLike[str] | None = None,
    stdin_name: str = "pipe:0",
    guard: bool = True,
) -> list[str]:
    """The encode command of docs/byte-exactness.md.

    ``stdin_name="-"`` with ``threads=None`` and ``guard=False`` is exactly
    imageio-ffmpeg's ``write_frames`` command for ``mimsave(..., codec="libx264",
    output_params=["-preset", preset])``; ``threads`` goes after the preset, as
    ``output_params=["-preset", preset, "-threads", n]`` would put it. ``guard``
    adds each input's protocol and demuxer whitelist (the worker always does).
    """
    argv = [ffmpeg, "-y", *(PIPE_GUARD if guard else ())]
    argv += ["-f", "rawvideo", "-vcodec", "rawvideo", "-s", f"{width}x{height}"]
    argv += ["-pix_fmt", "rgb24", "-r", fps_arg(fps), "-i", stdin_name]
    if audio is None:
        argv += ["-an"]
    else:
        argv += [*(AUDIO_FILE_GUARD if guard else ()), "-i", os.fspath(audio)]
    argv += ["-vcodec", "libx264", "-pix_fmt", "yuv420p", "-crf", str(crf_for_quality(quality))]
    if (width, height) != padded_size(width, height):
        argv += ["-vf", "scale={}:{}".format(*padded_size(width, height))]
    argv += ["-v", "warning", "-preset", preset]
    if threads is not None:
        argv += ["-threads", str(threads)]
    if audio is not None:
        argv += ["-acodec", "aac", "-map", "0:v:0", "-map", "1:a:0"]
    argv.append(os.fspath(output))
    return argv


def decode_argv(
    ffmpeg: str,
    *,
    path: str | os.PathLike[str],
    fps: float,
    width: int,
    height: int,
    start: float = 0.0,
    max_frames: int | None = None,
    out_fd: int = 1,
    guard: bool = True,
) -> list[str]:
    """The reference-decode command of docs/byte-exactness.md, writing rgb24 to ``pipe:{out_fd}``.

    ``guard`` adds the input's protocol and demuxer whitelist (the worker and the
    local fallback always do: the same command either way).
    """
    argv = [ffmpeg, "-v", "error"]
    if start > 0:
        argv += ["-ss", f"{start:.9g}"]
    if guard:
        argv += VIDEO_FILE_GUARD
    argv += ["-i", os.fspath(Path(path)), "-map", "0:v:0", "-an"]
    argv += ["-vf", f"fps={fps:g},scale={width}:{height}:flags=lanczos,setsar=1"]
    if max_frames is not None:
        argv += ["-frames:v", str(max_frames)]
    argv += ["-f", "rawvideo", "-pix_fmt", "rgb24", f"pipe:{out_fd}"]
    return argv
