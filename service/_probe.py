"""Media facts read in-process with PyAV: no ffprobe process per file.

PyAV is imported on first use: a host without it (the GPU check's) still serves
encodes, unvalidated, and answers what needs PyAV with 503 ``pyav_missing``.
"""

from __future__ import annotations

import functools
import os
from fractions import Fraction
from types import ModuleType
from typing import Any

from framewire.core.errors import MediaError, Unavailable
from framewire.core.media.argv import VIDEO_DEMUXERS
from framewire.core.media.inputs import InputFile
from framewire.core.wire import AudioInfo, MediaInfo

# Opening a file decodes its first pictures, for facts that only decoding tells (the
# pixel format); 1344x768 H.264 costs ~2.5 ms of a ~3.4 ms probe. Skipping them leaves
# everything else as it was.
NO_DECODING = {"skip_frame": "all"}
# What a file whose header holds every stream's facts needs read: that header alone. Else
# opening it reads up to 5 MB of packets to learn them (a 33-frame 832x480 output's
# check took 4.1 ms, 0.6 with this). Only MP4's and MOV's demuxer (its moov) is taken
# at that word: any other file is opened again as before.
HEADER_ONLY = {"probesize": "32", "analyzeduration": "0"}
INDEXED = "mov"
# The same restriction as the ffmpeg commands' (ffmpeg_argv): no demuxer that would
# follow a reference out of the file.
GUARD = {"protocol_whitelist": "file", "format_whitelist": VIDEO_DEMUXERS}


PYAV_MISSING = (
    "PyAV is not installed: outputs are not validated and the vllm-omni profile is refused"
)


@functools.cache  # asked per output: a missing module is not searched for again
def pyav() -> ModuleType | None:
    """The ``av`` module, or None where PyAV is not installed."""
    try:
        import av
    except ImportError:
        return None
    return av


def require_pyav() -> ModuleType:
    av = pyav()
    if av is None:
        raise Unavailable(PYAV_MISSING, code="pyav_missing")
    return av


def pyav_build() -> dict[str, str] | None:
    """PyAV's version and the libavcodec it was built with (the vllm-omni profile's bytes
    follow that build), or None without PyAV."""
    av = pyav()
    if av is None:
        return None
    major, minor, micro = av.library_versions["libavcodec"]
    return {"version": av.__version__, "libavcodec": f"{major}.{minor}.{micro}"}


def probe(
    source: str | os.PathLike[str] | InputFile,
    *,
    pixel_format: bool = True,
    header_only: bool = False,
) -> MediaInfo:
    """Frames, size, rate, codec, pixel format, duration and audio of a media file.

    Frame counts come from the container index (exact for MP4); streams without
    one are counted by demuxing, which reads packets but decodes nothing.
    ``pixel_format=False`` decodes nothing at all and reports ``pix_fmt`` as None
    (for checking outputs, whose first stream is their video). ``header_only`` (with
    it): an MP4 or MOV is known from its header alone (:data:`HEADER_ONLY`; an output
    the worker wrote, its moov whole). A path is opened here (a regular file only); an
    open :class:`InputFile` stays the caller's.
    """
    quick = header_only and not pixel_format
    if isinstance(source, InputFile):
        return _probe(source, pixel_format, quick)
    with InputFile.open(source) as opened:
        return _probe(opened, pixel_format, quick)


def _probe(source: InputFile, pixel_format: bool, header_only: bool) -> MediaInfo:
    av = require_pyav()
    try:
        if header_only:  # MP4 and MOV: their header says it all
            with _open(av, source, HEADER_ONLY, pixel_format) as container:
                if INDEXED in container.format.name.split(","):
                    return _facts(av, container, source.name)
        with _open(av, source, {}, pixel_format) as container:
            return _facts(av, container, source.name)
    except av.FFmpegError as exc:
        raise MediaError(
            f"{source.name}: not a readable media file ({exc})", code="not_video"
        ) from exc


def _open(av: ModuleType, source: InputFile, options: dict[str, str], pixel_format: bool) -> Any:
    return av.open(
        source.ffmpeg_path,
        metadata_errors="ignore",
        container_options={**GUARD, **options},
        stream_options=None if pixel_format else [NO_DECODING],  # one dict per stream
    )


def _facts(av: ModuleType, container: Any, path: str) -> MediaInfo:
    videos = container.streams.video
    if not videos:
        raise MediaError(f"{path}: no video stream", code="not_video")
    video = videos[0]
    ctx = video.codec_context
    rate = video.average_rate or video.base_rate or Fraction(0)
    frames = video.frames
    if not frames:
        frames = sum(1 for p in container.demux(video) if p.size)
    duration = None
    if video.duration is not None and video.time_base is not None:
        duration = float(video.duration * video.time_base)
    elif container.duration is not None:
        duration = container.duration / av.time_base
    audio = None
    if container.streams.audio:
        a = container.streams.audio[0]
        a_dur = None
        if a.duration is not None and a.time_base is not None:
            a_dur = float(a.duration * a.time_base)
        audio = AudioInfo(
            codec=a.codec_context.name,
            sample_rate=a.codec_context.sample_rate or 0,
            channels=a.codec_context.channels or 0,
            duration=a_dur,
        )
    return MediaInfo(
        path=path,
        frames=int(frames),
        width=ctx.width,
        height=ctx.height,
        fps=float(rate),
        fps_exact=str(Fraction(rate)),
        codec=ctx.name,
        pix_fmt=ctx.pix_fmt,
        duration=duration,
        audio=audio,
    )
