"""The ``vllm-omni`` profile's encoder: a child process that writes an MP4 as vLLM-omni does.

    python -P .../framewire/service/_encode/pyav_writer.py --size WxH --rate N/D --crf C
        [--preset P] --threads T [--audio FD,OFFSET,SAMPLES,CHANNELS,RATE] OUTPUT

Run as above, it writes one output and exits; forked from the template
(pyav_template.py, which imports this file), each writer does the same, once.

vLLM-omni 0.30 encodes with PyAV, not the ffmpeg command line
(``media_utils.mux_video_audio_bytes`` and ``ChunkedMP4Encoder``): an mp4
container with no options, an ``h264`` stream at the given rational rate,
``yuv420p``, its options ``crf`` then ``preset`` and ``threads``, each frame
from an rgb24 array, the encoder flushed, then the audio (if any) as one
float32 planar frame at pts 0, encoded after the video. The worker runs this
like ffmpeg: rgb24 frames on stdin (fed from staging by ``sendfile``), stderr
kept, every wait bounded, killed on cancel. The argv is built in
``framewire.core.media.argv.pyav_argv``; the bytes equal the engine's when
this PyAV build is the engine's (the MP4 carries libavformat's version).
"""

from __future__ import annotations

import argparse
import array
import os
import queue
import sys
import threading
from collections.abc import Iterator
from fractions import Fraction
from typing import NoReturn

import av
import av.subtitles.stream  # add_stream's first call imports it: see the note below
from av.video.reformatter import VideoReformatter

# av.subtitles.stream, imported above, is what ``add_stream`` imports on its first call:
# imported here, it is imported once by the template (pyav_template.py) rather than by
# each writer forked from it (about 1 ms of each encode's start).

# core.media.argv.OTHER_PYAV_EXIT, spelled here: this child imports nothing of framewire.
OTHER_PYAV_EXIT = 78
IOV_MAX = os.sysconf("SC_IOV_MAX")
# PyAV's own frame of a planar float32 waveform has one plane per channel of its layout.
LAYOUT_CHANNELS = {"mono": 1, "stereo": 2}


def _read_exactly(stream: int, views: list[memoryview]) -> bool:
    """Fill ``views`` in order from ``stream`` (scattered reads); False at a clean end of
    input before the first byte."""
    total, got, i, at = sum(len(v) for v in views), 0, 0, 0
    while i < len(views):
        n = os.readv(stream, [views[i][at:], *views[i + 1 : i + IOV_MAX]])
        if n == 0:
            if got == 0:
                return False
            raise SystemExit(f"input ended inside a frame ({got} of {total} bytes)")
        got += n
        while i < len(views) and n >= len(views[i]) - at:
            n -= len(views[i]) - at
            i, at = i + 1, 0
        at += n
    return True


def _waveform(spec: str) -> tuple[array.array[float], int, int]:
    """The float32 samples of an inherited memfd, channels interleaved, their channel
    count and rate (``--audio FD,OFFSET,SAMPLES,CHANNELS,RATE``)."""
    fd, offset, samples, channels, rate = (int(v) for v in spec.split(","))
    flat = array.array("f", [0.0]) * (samples * channels)  # made whole once, then filled
    # pread, not seek and read: the WAV's descriptor (its file position too) is shared
    # with every other output that muxes the same audio at the same time.
    view, got = memoryview(flat).cast("B"), 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise SystemExit("the audio input is shorter than its header says")
        got += n
    os.close(fd)
    return flat, channels, rate


def _audio_frame(flat: array.array[float], channels: int, rate: int, layout: str) -> av.AudioFrame:
    """The one planar frame PyAV's ``AudioFrame.from_ndarray(waveform, format="fltp",
    layout=layout)`` makes of the engine's (channels, samples) array: the same frame and
    bytes, without numpy (its import was a quarter to a third of this child's start,
    0.03-0.04 of 0.11-0.14 CPU-s, as the template now starts: benchmarks/template_start.py)."""
    if channels != LAYOUT_CHANNELS[layout]:  # PyAV refuses such an array alike
        raise ValueError(f"{channels} channels for a {layout} layout")
    frame = av.AudioFrame(format="fltp", layout=layout, samples=len(flat) // channels)
    for channel, plane in enumerate(frame.planes):
        plane.update(flat[channel::channels].tobytes())
    frame.sample_rate, frame.pts, frame.time_base = rate, 0, Fraction(1, rate)
    return frame


def _frames(width: int, height: int) -> Iterator[av.VideoFrame]:
    """Each rgb24 frame on stdin, read straight into one frame's buffer (row by row where
    its rows are padded), handed to the encoder as a new frame would be (no timestamp:
    the encoder numbers it). It is converted to yuv420p (a new frame) before the next is
    read, so the buffer is free again by then."""
    frame = av.VideoFrame(width, height, "rgb24")
    plane, row = frame.planes[0], width * 3
    pixels = memoryview(plane).cast("B")
    if plane.line_size == row:  # rows unpadded: the plane is the frame's bytes
        views = [pixels[: row * height]]
    else:
        step = plane.line_size
        views = [pixels[r * step : r * step + row] for r in range(height)]
    while _read_exactly(0, views):
        frame.pts = None
        yield frame


def _one_swscale_thread() -> dict[str, int]:
    """The keyword that runs swscale on one thread, where this PyAV takes it (16 has no
    such keyword: its swscale runs on one)."""
    try:
        VideoReformatter().reformat(av.VideoFrame(2, 2, "rgb24"), 2, 2, "yuv420p", threads=1)
    except TypeError:
        return {}
    return {"threads": 1}


SWSCALE = _one_swscale_thread()  # asked at the import, before any encode's job

# Frames converted and not yet encoded: two keep x264 fed, each a yuv420p picture.
CONVERTED_AHEAD = 2
_END = object()


def _converted_ahead(
    frames: Iterator[av.VideoFrame], width: int, height: int
) -> Iterator[av.VideoFrame]:
    """``frames`` as the ``yuv420p`` pictures PyAV's ``encode`` would convert them to,
    converted in a thread of their own while the encoder works on the ones before
    (PyAV converts in the thread that encodes: x264 waits for each conversion; ahead,
    the same CPU takes 0.8-0.9x the wall on free cores). The same conversion, swscale
    with the encoder's defaults, on one thread (its thread count does not change a
    pixel: tests/service/encode/test_profiles.py): the encoder, given yuv420p, converts
    nothing, and its bytes are those of the rgb24 frames. A failure to read or convert
    is raised here, in the encoding thread."""
    ready: queue.Queue[object] = queue.Queue(CONVERTED_AHEAD)

    def convert() -> None:
        reformatter = VideoReformatter()
        try:
            for frame in frames:
                ready.put(reformatter.reformat(frame, width, height, "yuv420p", **SWSCALE))
        except (Exception, SystemExit) as exc:  # a short read exits: raised again there
            ready.put(exc)
        else:
            ready.put(_END)

    # A daemon: an encode that fails ends the process without waiting for it.
    threading.Thread(target=convert, name="convert", daemon=True).start()
    while (item := ready.get()) is not _END:
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, av.VideoFrame)
        yield item


def encode(args: argparse.Namespace) -> None:
    width, height = (int(v) for v in args.size.split("x"))
    container = av.open(args.output, mode="w", format="mp4")
    stream = container.add_stream("h264", rate=Fraction(args.rate))
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    options: dict[str, str] = {"crf": str(args.crf)}
    if args.preset is not None:
        options["preset"] = args.preset
    options["threads"] = str(args.threads)
    stream.options = dict(options)
    audio_stream = waveform = None
    if args.audio is not None:
        waveform = _waveform(args.audio)
        # Added before any video is encoded, as the engine does: stream order is part of
        # the file.
        audio_stream = container.add_stream("aac", rate=waveform[2])
        audio_stream.layout = "stereo" if waveform[1] >= 2 else "mono"
    for picture in _converted_ahead(_frames(width, height), width, height):
        for packet in stream.encode(picture):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
    if audio_stream is not None and waveform is not None:
        frame = _audio_frame(*waveform, audio_stream.layout.name)
        for packet in audio_stream.encode(frame):
            container.mux(packet)
        for packet in audio_stream.encode():
            container.mux(packet)
    container.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyav_writer")
    parser.add_argument("--size", required=True)
    parser.add_argument("--rate", required=True)
    parser.add_argument("--crf", type=int, required=True)
    parser.add_argument("--preset", default=None)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--audio", default=None)
    parser.add_argument("--pyav-version", default=None)
    parser.add_argument("output")
    return parser


# Made at the import, in the template (pyav_template.py) before any fork: argparse's
# first parser imports shutil (and through it lzma, bz2...), 4-6 ms of an encode's
# start when made after the job came.
PARSER = _parser()


def main(argv: list[str] | None = None) -> int:
    return run(sys.argv[1:] if argv is None else argv)


def run(argv: list[str]) -> int:
    args = PARSER.parse_args(argv)
    if args.pyav_version not in (None, av.__version__):
        # Its bytes would be another build's than the identity the request named.
        print(
            f"framewire: this writer imports PyAV {av.__version__}, not {args.pyav_version}",
            file=sys.stderr,
        )
        return OTHER_PYAV_EXIT
    try:
        encode(args)
    except av.FFmpegError as exc:
        print(f"pyav: {exc}", file=sys.stderr)
        return 1
    return 0


def exit_now(code: int) -> NoReturn:
    """Exit without tearing the interpreter down (PyAV's modules, ~40 ms the
    worker would wait for): the output is closed, and nothing else is left to flush."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
