"""One output: frames in, a complete MP4 out, byte-identical to the imageio path.

The stream route streams converted chunks from a staging memfd into ffmpeg with
``sendfile``. If it cannot run or breaks mid-way, the output is redone on the
fallback route (the whole clip materialized and piped to the same argv), which
produces the same bytes. Either way the file appears only when complete.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from framewire.core.errors import (
    BadRequest,
    Cancelled,
    MediaError,
    NotFound,
)
from framewire.core.media.argv import (
    encode_argv,
    pyav_argv,
    x264_auto_threads,
)
from framewire.core.media.inputs import InputFile
from framewire.core.media.pipe import FfmpegExited
from framewire.core.media.process import FfmpegProcess
from framewire.service._convert.convert import chunk_frames, convert_into
from framewire.service._convert.kept import KeptStaging
from framewire.service._convert.staging import ChunkWriter, slot_frames
from framewire.service._encode.children import Children
from framewire.service._encode.encoders import Encoders
from framewire.service._encode.params import EncodeParams, check_geometry, check_params
from framewire.service._encode.profiles import PYAV_CHILD, profile_writer
from framewire.service._encode.pump import Progress, Pump, chunk_spans, send_in_pieces
from framewire.service._outputs import (
    Follower,
    TempOutput,
    open_directory,
    output_file,
    refuse_directory,
    sha256_of,
)
from framewire.service._sources.audio import MemoryAudio
from framewire.service._sources.frames import FrameSource, Geometry

if TYPE_CHECKING:
    from framewire.service._settings import Settings

Route = Literal["stream", "fallback", "local"]  # local: in the client's process, no worker


@dataclass
class Encoded:
    path: Path
    bytes: int
    sha256: str
    frames: int
    width: int
    height: int
    route: Route
    threads: int
    encode_ms: float
    fast_path_error: str | None = None  # why the fallback ran, when it did


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return sha256_of(f)[1]


class Encoder:
    """Encodes frame sources to files. Thread-safe: each call owns all it touches."""

    def __init__(
        self,
        ffmpeg: str | None = None,
        *,
        chunk_bytes: int = 128 << 20,
        fallback: bool = True,
        stall_s: float | None = 60.0,
        encoders: list[str] | None = None,
        pyav_fork: bool = False,
        staging_keep_bytes: int = 0,
    ):
        self.encoders = Encoders(ffmpeg, encoders)
        self.kept = KeptStaging(staging_keep_bytes)  # staging memfds between encodes
        self.children = Children(pyav_fork, self.encoders.explain)
        self.ffmpeg = self.encoders.default
        self.chunk_bytes = chunk_bytes
        self.fallback = fallback
        self.stall_s = stall_s  # an ffmpeg making no progress this long is killed

    @classmethod
    def from_settings(cls, settings: Settings) -> Encoder:
        return cls(
            settings.ffmpeg,
            chunk_bytes=settings.chunk_bytes,
            fallback=settings.fallback,
            stall_s=settings.stall_timeout_s,
            encoders=settings.encoders,
            pyav_fork=settings.pyav_fork,
            staging_keep_bytes=settings.staging_keep_mib << 20,
        )

    def threads_for(self, height: int, params: EncodeParams) -> int:
        return params.threads or x264_auto_threads(height)

    def frames_per_chunk(self, g: Geometry) -> int:
        """Frames converted at once on the stream route: within the chunk budget and
        one staging slot."""
        return min(
            chunk_frames(self.chunk_bytes, g.height, g.width, g.dtype.itemsize),
            slot_frames(g.height, g.width),
        )

    def gpu_bytes(self, source: FrameSource) -> int:
        """GPU memory an encode of ``source`` holds while it runs (for admission)."""
        return source.gpu_bytes(self.frames_per_chunk(source.geometry))

    def encode(
        self,
        source: FrameSource,
        path: str | os.PathLike[str],
        params: EncodeParams,
        *,
        cancel: threading.Event | None = None,
        directory: int | None = None,
        inspect: Callable[[str], None] | None = None,
        progress: Progress | None = None,
        follower: Follower | None = None,
        durable: bool = True,
    ) -> Encoded:
        """Encode ``source`` to ``path``.

        ``directory``: an open fd for ``path``'s directory (the worker's, opened
        without following links); by default the directory is opened here.
        ``inspect`` runs on the finished file (by its path in the private directory) before it is
        renamed into place, and may raise to refuse it. ``progress`` is told the
        frames fed to ffmpeg so far, piece by piece (from 0 again if the reference
        route redoes the output). ``follower`` is told where the file is written and
        checked between pieces (an object's early upload). ``durable``: the file is
        fsynced before it is renamed into place (not a spooled one's).
        """
        check_params(params)
        g = source.geometry
        check_geometry(params, g.width, g.height, g.dtype)
        if source.geometry.frames < 1:  # the wire refuses these; a direct caller might not
            raise BadRequest("the clip has no frames", code="no_frames")
        path = Path(path)
        if isinstance(params.audio, Path):
            try:
                audio = InputFile.open(params.audio)
            except NotFound as exc:
                raise NotFound(exc.message, code="audio_missing") from None
            try:
                return self.encode(
                    source,
                    path,
                    replace(params, audio=audio),
                    cancel=cancel,
                    directory=directory,
                    inspect=inspect,
                    progress=progress,
                    follower=follower,
                    durable=durable,
                )
            finally:
                audio.close()
        own = directory is None
        if directory is None:
            try:
                directory = open_directory(path.parent)
            except (FileNotFoundError, NotADirectoryError) as exc:
                raise NotFound(
                    f"output directory {path.parent} does not exist", code="output_dir_missing"
                ) from exc
        try:
            return self._encode(
                source, path, params, cancel, directory, inspect, progress, follower, durable
            )
        finally:
            if own:
                os.close(directory)

    def _encode(
        self,
        source: FrameSource,
        path: Path,
        params: EncodeParams,
        cancel: threading.Event | None,
        directory: int,
        inspect: Callable[[str], None] | None,
        progress: Progress | None,
        follower: Follower | None,
        durable: bool,
    ) -> Encoded:
        refuse_directory(directory, path)

        def check() -> None:
            if cancel is not None and cancel.is_set():
                raise Cancelled("the encode was cancelled")
            if follower is not None:
                follower.check()

        g = source.geometry
        threads = self.threads_for(g.height, params)
        started = time.perf_counter()
        route: Route = "stream"
        fast_error: str | None = None
        with output_file(directory, path.name, durable=durable, follower=follower) as temp:
            if follower is not None:
                follower.writing(temp)
            try:
                self._stream(source, temp, params, threads, check, progress)
            except (Cancelled, BadRequest):
                raise  # the caller's fault or wish: the fallback route would not help
            except (MediaError, OSError) as exc:
                # ffmpeg refusing its input or output (status > 0: bad audio, full disk)
                # would refuse the fallback route too; a killed ffmpeg or a stream-route
                # syscall failing would not.
                retry = isinstance(exc, OSError) or exc.code == "ffmpeg_killed"
                if not (self.fallback and retry):
                    raise
                check()
                route, fast_error = "fallback", str(exc)
                self._fallback_route(source, temp, params, check, progress)
            encode_ms = (time.perf_counter() - started) * 1e3
            size, sha256 = temp.digest_inspected(inspect, follower)
        return Encoded(
            path=path,
            bytes=size,
            sha256=sha256,
            frames=g.frames,
            width=g.width,
            height=g.height,
            route=route,
            threads=threads,
            encode_ms=encode_ms,
            fast_path_error=fast_error,
        )

    def argv(
        self, temp: TempOutput, width: int, height: int, params: EncodeParams, **kw: object
    ) -> list[str]:
        """The encode command writing ``temp`` (``threads=``, ``stdin_name=`` pass on):
        ffmpeg's, or the PyAV child's for the ``vllm-omni`` profile."""
        audio = None if params.audio is None else _audio(params)
        common = {
            "width": width,
            "height": height,
            "fps": params.fps,
            "output": temp.path,
            "quality": params.quality,
            "preset": params.resolved_preset,
        }
        if params.profile == "vllm-omni":
            # What the engine passes, on every route: the threads asked for, else "0"
            # (x264's own slice-thread count). The frame-thread count the other routes
            # pass (x264_auto_threads, for the scheduler too) would give other bytes.
            return pyav_argv(
                PYAV_CHILD,
                **common,  # type: ignore[arg-type]
                threads=params.threads,
                audio=audio.pyav_spec() if isinstance(audio, MemoryAudio) else None,
                pyav_version=self.encoders.pyav_version(),
            )
        return encode_argv(
            params.ffmpeg or self.ffmpeg,
            **common,  # type: ignore[arg-type]
            audio=None if audio is None else audio.ffmpeg_path,
            profile=params.profile,
            muxer=temp.muxer,
            **kw,  # type: ignore[arg-type]
        )

    def _stream(
        self,
        source: FrameSource,
        temp: TempOutput,
        params: EncodeParams,
        threads: int,
        check: Callable[[], None],
        progress: Progress | None = None,
    ) -> None:
        g = source.geometry
        argv = self.argv(temp, g.width, g.height, params, threads=threads)
        per_chunk = self.frames_per_chunk(g)
        with self.start(argv, temp, params) as ff:
            pipe = ff.input
            assert pipe is not None
            try:
                span = source.zero_copy()
                if span is not None:
                    fd, offset = span
                    frame = g.height * g.width * 3

                    def send(t0: int, t1: int) -> None:
                        pipe.send_file(fd, offset + t0 * frame, (t1 - t0) * frame, check)

                    send_in_pieces(g.frames, per_chunk, send, progress)
                else:
                    with Pump(pipe, g.height, g.width, per_chunk, kept=self.kept) as pump:
                        pump.send(source, check, self.writer(source, params), progress=progress)
            except FfmpegExited as exc:
                raise self.children.cut_short(ff, check) from exc
            self.children.wait_for(ff, check)

    def _fallback_route(
        self,
        source: FrameSource,
        temp: TempOutput,
        params: EncodeParams,
        check: Callable[[], None],
        progress: Progress | None,
    ) -> None:
        """The in-process path: the whole clip as uint8, piped into imageio-ffmpeg's argv.

        Conversion goes chunk by chunk into the uint8 clip, so the fallback holds
        one byte per sample, not the float copies of the old path.
        """
        g = source.geometry
        frames = torch.empty((g.frames, g.height, g.width, 3), dtype=torch.uint8)
        writer = self.writer(source, params) or source.chunk_writer()
        if writer is not None:
            # The source's own converter (on its GPU), at the stream route's chunk size:
            # the GPU memory admitted for this encode was counted at that size.
            writer.open(None, self.frames_per_chunk(g))
            try:
                for t0, t1 in chunk_spans(g.frames, self.frames_per_chunk(g)):
                    check()
                    writer.write(functools.partial(frames.__getitem__, slice(t0, t1)), t0, t1)
            finally:
                writer.close()
        else:
            per_chunk = chunk_frames(self.chunk_bytes, g.height, g.width, g.dtype.itemsize)
            for t0, t1 in chunk_spans(g.frames, per_chunk):
                check()
                chunk, owned = source.read(t0, t1)
                convert_into(chunk, g.layout, frames[t0:t1], inplace=owned)
        check()
        argv = self.argv(temp, g.width, g.height, params, threads=params.threads, stdin_name="-")
        with self.start(argv, temp, params) as ff:
            pipe = ff.input
            assert pipe is not None
            data = frames.numpy().data.cast("B")
            frame = g.height * g.width * 3

            def send(t0: int, t1: int) -> None:
                pipe.send(data[t0 * frame : t1 * frame], check)

            try:
                send_in_pieces(g.frames, self.frames_per_chunk(g), send, progress)
            except FfmpegExited:
                pass  # wait_for reports ffmpeg's exit status and stderr
            self.children.wait_for(ff, check)

    def writer(self, source: FrameSource, params: EncodeParams) -> ChunkWriter | None:
        """The profile's converter for ``source``; None: the standard conversion."""
        return profile_writer(source, params.profile, params.value_range)

    def start(
        self, argv: list[str], temp: TempOutput, params: EncodeParams, live_fd: int | None = None
    ) -> FfmpegProcess:
        """ffmpeg running ``argv``, frames to be fed on its stdin (``live_fd``: the pipe
        its live view goes into, when ``argv`` has one)."""
        # The private directory's fd (and the audio's): ffmpeg names them through
        # /proc/self/fd, so it opens exactly what was judged.
        fds = [temp.fd] if params.audio is None else [temp.fd, _audio(params).fd]
        fds += [] if live_fd is None else [live_fd]
        return self.children.start(argv, fds, self.stall_s, params.priority)

    def close(self) -> None:
        """Let go of what the encoder keeps between encodes (its PyAV writers' template,
        its binaries' descriptors, its staging memfds)."""
        self.children.close()
        self.encoders.close()
        self.kept.close()


def _audio(params: EncodeParams) -> InputFile:
    assert isinstance(params.audio, InputFile), "encode() opens an audio path first"
    return params.audio
