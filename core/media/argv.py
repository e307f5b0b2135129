"""The ffmpeg command lines of the byte-exact contracts, in exactly one place.

Both the worker's fast paths and the reference/fallback paths build their argv
here, and the tests compare these against what imageio-ffmpeg runs. Any change
to a single token can change output bytes, so nothing else in the project may
spell these commands out.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Protocol

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


# The engine save paths an output may reproduce byte for byte (docs/engines.md).
PROFILES = ("imageio", "sglang", "diffusers", "vllm-omni")
DEFAULT_QUALITY = 5
VLLM_OMNI_CRF = 18  # vLLM-omni's encoders' default
DEFAULT_PRESETS: dict[str, str | None] = {
    "imageio": "fast",
    "sglang": "fast",
    "diffusers": None,  # export_to_video passes none: x264's own (medium)
    "vllm-omni": "ultrafast",  # its serving default
}


def rate_arg(profile: str, fps: float | Fraction) -> str:
    """The ``-r`` value each engine writes: SGLang's rounded to 2 decimals (23.976 ->
    23.98), PyAV's (vLLM-omni) a rational within 1/10000, imageio-ffmpeg's exact."""
    if profile == "sglang":
        return f"{float(fps):.02f}"
    if profile == "vllm-omni":
        rate = Fraction(fps).limit_denominator(10000)
        return f"{rate.numerator}/{rate.denominator}"
    return fps_arg(fps)


def profile_rate(profile: str, fps: float) -> Fraction:
    """:func:`rate_arg` as the rate the file ends up with."""
    return Fraction(rate_arg(profile, fps))


def output_size(profile: str, width: int, height: int) -> tuple[int, int]:
    """The size of the encoded picture: the ffmpeg writers scale up to multiples of 16."""
    return (width, height) if profile == "vllm-omni" else padded_size(width, height)


def crf_for(profile: str, quality: float | None) -> int:
    if quality is None:
        return VLLM_OMNI_CRF if profile == "vllm-omni" else crf_for_quality(DEFAULT_QUALITY)
    return crf_for_quality(quality)


def encode_argv(
    ffmpeg: str,
    *,
    width: int,
    height: int,
    fps: float | Fraction,
    output: str | os.PathLike[str],
    quality: float | None = DEFAULT_QUALITY,
    preset: str | None = "fast",
    threads: int | None = None,
    audio: str | os.PathLike[str] | None = None,
    stdin_name: str = "pipe:0",
    guard: bool = True,
    profile: str = "imageio",
    live_fd: int | None = None,
    muxer: str | None = None,
) -> list[str]:
    """The encode command of docs/byte-exactness.md (``profile="imageio"``) or of an
    engine's own save path (``sglang``, ``diffusers``; docs/engines.md).

    ``stdin_name="-"`` with ``threads=None`` and ``guard=False`` is exactly
    imageio-ffmpeg's ``write_frames`` command for ``mimsave(..., codec="libx264",
    output_params=["-preset", preset])``; ``threads`` goes after the preset, as
    ``output_params=["-preset", preset, "-threads", n]`` would put it. ``preset=None``
    passes none (diffusers' ``export_to_video``). ``guard`` adds each input's protocol
    and demuxer whitelist (the worker always does). ``live_fd``: the same encode also
    muxes a fragmented MP4 into that fd (:func:`live_output`); the file keeps its bytes.
    ``muxer``: the output's muxer, for an output whose name has no extension (a memfd's
    ``/proc/self/fd/N``); the muxer its extension would pick writes the same bytes.
    """
    if profile not in ("imageio", "sglang", "diffusers"):
        raise ValueError(f"profile {profile!r} is not encoded by an ffmpeg command")
    argv = [ffmpeg, "-y", *(PIPE_GUARD if guard else ())]
    argv += ["-f", "rawvideo", "-vcodec", "rawvideo", "-s", f"{width}x{height}"]
    argv += ["-pix_fmt", "rgb24", "-r", rate_arg(profile, fps), "-i", stdin_name]
    if audio is None:
        argv += ["-an"]
    else:
        argv += [*(AUDIO_FILE_GUARD if guard else ()), "-i", os.fspath(audio)]
    crf = ["-crf", str(crf_for(profile, quality))]
    scale: list[str] = []
    if (width, height) != padded_size(width, height):
        scale = ["-vf", "scale={}:{}".format(*padded_size(width, height))]
    threads_arg = [] if threads is None else ["-threads", str(threads)]
    audio_out = [] if audio is None else ["-acodec", "aac", "-map", "0:v:0", "-map", "1:a:0"]
    if profile == "sglang":
        # SGLang 0.5.23's _cuda_video_ffmpeg_command. Its CPU path's _save_video_ffmpeg
        # differs only in options that change no byte: no -threads where x264 picks the
        # same count, no -map with one stream of each kind, no -v.
        argv += ["-vcodec", "libx264", "-preset", preset or "fast", "-pix_fmt", "yuv420p"]
        argv += [*crf, *scale, *threads_arg, *audio_out, "-v", "warning"]
    else:
        argv += ["-vcodec", "libx264", "-pix_fmt", "yuv420p", *crf, *scale, "-v", "warning"]
        argv += [] if preset is None else ["-preset", preset]
        argv += [*threads_arg, *audio_out]
    if live_fd is None:
        argv += [] if muxer is None else ["-f", muxer]
        argv.append(os.fspath(output))
    else:
        argv += live_output(os.fspath(output), live_fd, mapped=audio is not None, muxer=muxer)
    return argv


# The live view's fragments: cut by time, since the file's GOP (x264's default, 250
# frames) is far longer than a viewer can wait. Fragments after the first may start
# on a non-keyframe; Media Source Extensions take them.
LIVE_FRAGMENT_US = 100_000
# x264's default keyint, which no profile changes (another would change the file): the
# most frames from one keyframe to the next, so the longest an HLS segment can be.
GOP_FRAMES = 250
LIVE_MOVFLAGS = "frag_keyframe+empty_moov+default_base_moof"


def _tee_quoted(name: str) -> str:
    """``name`` as one slave of the tee muxer: quoted, so ``|``, ``[``, ``\\`` and
    spaces in it are the file's own."""
    return "'" + name.replace("'", "'\\''") + "'"


def live_output(output: str, fd: int, *, mapped: bool, muxer: str | None = None) -> list[str]:
    """The output options that write ``output`` as before and a fragmented MP4 of the
    same packets to ``pipe:{fd}``.

    ``+global_header`` makes the encoders put their headers out of band, as the file's
    muxer alone would have asked: without it x264's bitstream (and so the file)
    changes. The tee muxer has no default streams, so the video is mapped when nothing
    else maps it (``-map 0:v:0`` alone selects what ffmpeg would). ``onfail=ignore``:
    a viewer pipe that breaks never fails the file.
    """
    live = f"[f=mp4:movflags={LIVE_MOVFLAGS}:frag_duration={LIVE_FRAGMENT_US}:onfail=ignore]"
    out = [] if mapped else ["-map", "0:v:0"]
    out += ["-flags", "+global_header", "-f", "tee"]
    named = "" if muxer is None else f"[f={muxer}]"
    return [*out, f"{named}{_tee_quoted(output)}|{live}pipe:{fd}"]


OTHER_PYAV_EXIT = 78  # sysexits' EX_CONFIG: the writer's PyAV is not the one named


def pyav_argv(
    child: Sequence[str],
    *,
    width: int,
    height: int,
    fps: float,
    output: str | os.PathLike[str],
    quality: float | None = None,
    preset: str | None = "ultrafast",
    threads: int | None = None,
    audio: tuple[int, int, int, int, int] | None = None,
    pyav_version: str | None = None,
) -> list[str]:
    """The child that encodes as vLLM-omni 0.30's PyAV writers do (``vllm-omni``
    profile): rgb24 frames on stdin, ``output`` written by PyAV's mp4 muxer. ``child``:
    the command that runs the writer (the service's, which the core does not name).

    ``threads=None`` is vLLM-omni's ``"0"``: x264's own count, in slices, so the
    bytes follow the machine's CPU count; pin it for the same bytes everywhere.
    ``audio``: (fd, data offset, samples, channels, sample_rate) of float32 samples.
    ``pyav_version``: the PyAV the request's identity names; a child that imports another
    (PyAV upgraded under the worker) writes nothing and exits :data:`OTHER_PYAV_EXIT`.
    """
    argv = list(child)
    if pyav_version is not None:
        argv += ["--pyav-version", pyav_version]
    argv += ["--size", f"{width}x{height}", "--rate", rate_arg("vllm-omni", fps)]
    argv += ["--crf", str(crf_for("vllm-omni", quality))]
    if preset is not None:
        argv += ["--preset", preset]
    argv += ["--threads", str(0 if threads is None else threads)]
    if audio is not None:
        argv += ["--audio", ",".join(str(n) for n in audio)]
    argv.append(os.fspath(output))
    return argv


class Decode(Protocol):
    """What a reference decode asks: a ``core.wire.DecodeRequest``, by the fields read
    here (the wire models import this module, not the other way round)."""

    path: str
    fps: float
    width: int
    height: int
    start: float
    max_frames: int | None


def decode_argv(
    ffmpeg: str,
    decode: Decode,
    *,
    path: str | os.PathLike[str] | None = None,
    out_fd: int = 1,
    guard: bool = True,
) -> list[str]:
    """The reference-decode command of docs/byte-exactness.md, writing rgb24 to ``pipe:{out_fd}``.

    ``path``: where ffmpeg opens the file, when not at ``decode.path`` (a descriptor's
    /proc path). ``guard`` adds the input's protocol and demuxer whitelist (the worker
    and the local fallback always do: the same command either way).
    """
    argv = [ffmpeg, "-v", "error"]
    if decode.start > 0:
        argv += ["-ss", f"{decode.start:.9g}"]
    if guard:
        argv += VIDEO_FILE_GUARD
    source = decode.path if path is None else path
    argv += ["-i", os.fspath(Path(source)), "-map", "0:v:0", "-an"]
    scale = f"scale={decode.width}:{decode.height}:flags=lanczos,setsar=1"
    argv += ["-vf", f"fps={decode.fps:g},{scale}"]
    if decode.max_frames is not None:
        argv += ["-frames:v", str(decode.max_frames)]
    argv += ["-f", "rawvideo", "-pix_fmt", "rgb24", f"pipe:{out_fd}"]
    return argv
