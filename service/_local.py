"""Encoding in the calling process: what a client does when no worker can be reached.

A rank that adopted framewire must never fail a save its engine would have
written, so with no worker its client encodes here, with the worker's own parts:
the same conversion, argv and atomic output, so the same bytes (x264's thread
count follows this process's CPUs, as it would the worker's: pin ``threads`` for
the same bytes everywhere). Frames are read where they lie and converted in
bounded chunks, never materialized whole, so there is no fallback route to fall
back to: a failed encode fails.

The client finds :class:`LocalEncoder` through the core's seam
(``framewire.core.local``: an entry point this package declares), only when it
needs it, so an inference process without the service's extra still imports
the client.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from framewire.core.errors import BadRequest
from framewire.core.frames import Frames, describe, is_cuda, waveform
from framewire.core.wire import AudioDType, OutputResult, RegionAudio
from framewire.service._access.paths import (
    keep_made,
    nearest_directory,
    open_output_dir,
    remove_made,
    resolve_output,
)
from framewire.service._encode.encoder import Encoded, EncodeParams, Encoder
from framewire.service._encode.results import Check, check_for, output_result
from framewire.service._sources.audio import MemoryAudio, samples_of
from framewire.service._sources.frames import FrameSource, Geometry, TensorSource
from framewire.service._stream.output import StreamOutput


def _no_cancel() -> None:
    return None


@dataclass(frozen=True)
class Options:
    """How an output is encoded: the keywords of ``save_video`` and ``open_video``."""

    fps: float
    quality: float | None = None
    preset: str | None = None
    threads: int | None = None
    audio: Any = None
    audio_sample_rate: int | None = None
    profile: str = "imageio"
    value_range: tuple[float, float] | None = None
    presign_s: int | None = None  # object URLs are the worker's: never written here
    live: bool = False  # a live view is the worker's: a local stream has no viewers
    ahead: bool = True  # how a worker answers chunks: a local stream has no answers
    validate: bool = True
    encoder: str | None = None  # an encoder identity: refused unless this process runs it


class LocalEncoder:
    """Saves and streams videos in this process. ``output_root``: where relative paths
    go (else ``FRAMEWIRE_OUTPUT_ROOTS``' first entry, else they are refused)."""

    def __init__(self, output_root: str | os.PathLike[str] | None = None):
        self.output_root = output_root
        # fallback=False: the fallback route materializes the whole clip.
        self.encoder = Encoder(fallback=False)

    def close(self) -> None:
        """The encoder's binaries' descriptors and its PyAV writers started ahead."""
        self.encoder.close()

    def resolve(self, path: str | os.PathLike[str]) -> tuple[Path, list[str]]:
        """Where ``path`` is written, judged by the worker's rules (``paths``: no ``..``,
        no reserved names, one-file formats, no link at the name), and the roots it was
        judged against: a relative path must stay under the output root, links followed;
        an absolute one is this process's own choice, judged below its nearest existing
        directory."""
        raw = os.fspath(path)
        if os.path.isabs(raw):
            root = nearest_directory(Path(raw).parent)
        else:
            root = self._root(raw)
            root.mkdir(parents=True, exist_ok=True)  # this process's own place
        roots = [str(root)]
        return resolve_output(raw, roots), roots

    def _root(self, raw: str) -> Path:
        root = self.output_root
        if root is None:
            configured = os.environ.get("FRAMEWIRE_OUTPUT_ROOTS", "").split(",")[0].strip()
            root = configured or None
        if root is None:
            raise BadRequest(
                f"no worker to write the relative path {raw!r}, and no place "
                "for it here: give Client(output_root=...) or FRAMEWIRE_OUTPUT_ROOTS",
                code="no_output_root",
            )
        return Path(root).absolute()

    def save(
        self, video: Any, path: str | os.PathLike[str], fields: dict[str, Any], layout: Any = None
    ) -> OutputResult:
        """One output, whole clip (``fields``: :class:`Options`'): the result a worker
        would give, ``route == "local"``."""
        options = Options(**fields)
        target, roots = self.resolve(path)
        frames = describe(video, layout)
        started = time.time()
        with contextlib.ExitStack() as stack:
            params = self._params(options, stack)
            source = stack.enter_context(contextlib.closing(_source(frames)))
            _, count, height, width = frames.dims
            geometry = Geometry(frames.dtype, frames.layout, count, height, width)
            check = check_for(count, geometry, params, options.validate)
            placed = _Placed(target, roots)
            stack.callback(placed.close)
            encoded = self.encoder.encode(
                source, target, params, directory=placed.fd, inspect=check
            )
            placed.written = True
        return _result(encoded, options, check, started)

    def open(
        self, path: str | os.PathLike[str], fields: dict[str, Any], first: Frames
    ) -> LocalStream:
        """A stream whose geometry is ``first``'s (the first chunk)."""
        return LocalStream(self, *self.resolve(path), Options(**fields), first)

    def _params(self, options: Options, stack: contextlib.ExitStack) -> EncodeParams:
        audio: Any = options.audio
        if audio is not None and not isinstance(audio, (str, os.PathLike)):
            audio = stack.enter_context(memory_audio(audio, options))
        elif audio is not None:
            audio = Path(audio)
        ffmpeg = self.encoder.encoders.pick(options.encoder, options.profile)
        return EncodeParams.asked(options, audio, ffmpeg=ffmpeg)


class LocalStream:
    """One output fed chunk by chunk in this process (a stream session without a worker)."""

    def __init__(
        self, owner: LocalEncoder, path: Path, roots: list[str], options: Options, first: Frames
    ):
        self.options = options
        self.frames = 0
        self._started = time.time()
        self._stack = contextlib.ExitStack()
        try:
            _, _, height, width = first.dims
            geometry = Geometry(first.dtype, first.layout, 0, height, width)
            self._params = owner._params(options, self._stack)
            self._placed = _Placed(path, roots)
            self._stack.callback(self._placed.close)
            self._output = StreamOutput(
                owner.encoder, path, self._params, geometry, self._placed.fd
            )
            self._stack.callback(self._output.abort)
        except BaseException:
            self._stack.close()
            raise

    def write(self, frames: Frames) -> None:
        with contextlib.closing(_source(frames)) as source:
            self._output.feed(source, _no_cancel)
        self.frames += frames.dims[1]

    def finish(self) -> OutputResult:
        try:
            g = self._output.geometry
            check = check_for(self.frames, g, self._params, self.options.validate)
            encoded = self._output.finish(_no_cancel, check)
            self._placed.written = True
            return _result(encoded, self.options, check, self._started)
        finally:
            self._stack.close()

    def abort(self) -> None:
        self._stack.close()


class _Placed:
    """The directory of an output made and opened as the worker does (``open_output_dir``);
    what was made for it is taken back unless the output was written."""

    def __init__(self, target: Path, roots: list[str]):
        self.made: list[Path] = []
        self.written = False
        try:
            self.fd = open_output_dir(target, roots, self.made)
        except BaseException:
            remove_made(self.made)
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            (keep_made if self.written else remove_made)(self.made)


def _source(frames: Frames) -> FrameSource:
    if is_cuda(frames.video):
        import torch
        from framewire.service._sources.cuda_convert import CudaTensorSource

        with torch.cuda.device(frames.video.device):
            event = torch.cuda.Event()
            event.record()  # the producer's work on its current stream comes first
        return CudaTensorSource(frames.video, frames.layout, event=event)
    return TensorSource(frames.video, frames.layout)


@contextlib.contextmanager
def memory_audio(audio: Any, options: Options) -> Any:
    """Samples as the worker muxes them: a WAV in a sealed memfd."""
    if options.audio_sample_rate is None:
        raise ValueError("audio samples need audio_sample_rate=")
    samples = waveform(audio)
    spec = RegionAudio(
        region="memory",
        dtype=AudioDType(samples.dtype.name),
        shape=list(samples.shape),
        sample_rate=int(options.audio_sample_rate),
        byte_size=samples.nbytes,
    )
    clamp = options.profile != "vllm-omni"  # as the worker judges it (prepare.py)
    raw = np.ascontiguousarray(samples).reshape(-1).view(np.uint8)
    with MemoryAudio(spec, samples_of(raw.data, spec, clamp=clamp)) as wav:
        yield wav


def _result(
    encoded: Encoded, options: Options, check: Check | None, started: float
) -> OutputResult:
    local = replace(encoded, route="local")
    return output_result(local, options.fps, check, started)
