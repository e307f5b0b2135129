"""One output fed chunk by chunk: its ffmpeg, pump and private file live across requests.

The frames go through the same argv, conversion and staging as a one-shot
encode, in the same order, so the file is byte-identical to an encode of the
concatenated frames whatever the chunking. The differences, because a chunk's
buffer is the producer's again once its request is answered:

- A chunk is answered once converted into the output's staging (up to
  ``ahead_bytes`` of it ahead of ffmpeg), not once ffmpeg read it: the producer's
  next chunk is made while x264 works on this one.
- With nothing ahead (``ahead_bytes`` 0), a chunk is answered at the encoder's
  pace: once its pipe took it, or, for rgb24 frames in shared memory, once the
  encoder has read them all, since those are ``sendfile``d from the producer's
  pages (never copied in the worker) and the pipe holds references to those
  pages, which the producer overwrites once answered.
- There is no fallback route: the frames already sent exist
  nowhere else any more. A failed ffmpeg fails the session.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from framewire.core.closing import Closing
from framewire.core.media.pipe import FfmpegExited
from framewire.service._encode.encoder import Encoded, EncodeParams, Encoder
from framewire.service._encode.pump import Pump
from framewire.service._outputs import Follower, output_file
from framewire.service._sources.frames import FrameSource, Geometry
from framewire.service._stream.live import LiveFeed


class _Aborted(Exception):
    """Thrown into the output's context managers: discard everything."""


class StreamOutput(Closing):
    """ffmpeg writing ``path`` (in ``directory``) from frames given by :meth:`feed`;
    ``durable``: fsynced before it is renamed into place (``atomic_output``)."""

    def __init__(
        self,
        encoder: Encoder,
        path: Path,
        params: EncodeParams,
        geometry: Geometry,
        directory: int,
        live: LiveFeed | None = None,
        follower: Follower | None = None,
        ahead_bytes: int = 0,
        durable: bool = True,
    ):
        self.path = path
        self.geometry = geometry
        self.frames = 0
        self.threads = encoder.threads_for(geometry.height, params)
        self._encoder, self._params = encoder, params
        self._follower = follower
        self._started = time.perf_counter()
        self._stack = contextlib.ExitStack()
        try:
            staged = output_file(directory, path.name, durable=durable, follower=follower)
            self._staged = self._stack.enter_context(staged)
            if follower is not None:
                follower.writing(self._staged)
            g = geometry
            live_fd = None if live is None else live.open_pipe()
            argv = encoder.argv(
                self._staged, g.width, g.height, params, threads=self.threads, live_fd=live_fd
            )
            try:
                ff = encoder.start(argv, self._staged, params, live_fd)
            finally:
                if live is not None:
                    live.started()  # the worker's copy of the write end goes either way
            self._ff = self._stack.enter_context(ff)
            assert self._ff.input is not None
            per_chunk = encoder.frames_per_chunk(g)
            self._pump = self._stack.enter_context(
                Pump(self._ff.input, g.height, g.width, per_chunk, ahead_bytes, encoder.kept)
            )
            self._wait = ahead_bytes == 0
        except BaseException:
            self.abort()
            raise

    def feed(self, source: FrameSource, check: Callable[[], None]) -> bool:
        """Convert all of ``source``'s frames; when this returns, ``source`` is not read any
        more. They are sent on while the next chunk comes, up to ``ahead_bytes`` of them
        (0: this waits until ffmpeg's pipe took them, or read them when they were sent
        as they lie: then this returns True); a failure to send them is raised by the
        next call."""
        # At the encoder's pace, frames that need no conversion are sent as they lie.
        span = source.zero_copy() if self._wait else None
        with self._cut_short(check):
            if span is not None:
                self._pump.send_uncopied(*span, source.geometry.nbytes, check)
            else:
                writer = self._encoder.writer(source, self._params)
                self._pump.send(source, check, writer, wait=self._wait)
        self.frames += source.geometry.frames
        return span is not None

    @contextlib.contextmanager
    def _cut_short(self, check: Callable[[], None]) -> Iterator[None]:
        try:
            yield
        except FfmpegExited as exc:
            raise self._encoder.children.cut_short(self._ff, check) from exc

    def finish(
        self, check: Callable[[], None], inspect: Callable[[str], None] | None = None
    ) -> Encoded:
        """End of frames: wait for ffmpeg, check the file (``inspect``), put it in place."""
        try:
            with self._cut_short(check):
                self._pump.flush()
            self._pump.close()
            self._encoder.children.wait_for(self._ff, check)
            encode_ms = (time.perf_counter() - self._started) * 1e3
            size, sha256 = self._staged.digest_inspected(inspect, self._follower)
        except BaseException:
            self.abort()
            raise
        self._stack.close()  # ffmpeg reaped, the file fsynced and renamed into place
        g = self.geometry
        return Encoded(
            path=self.path,
            bytes=size,
            sha256=sha256,
            frames=self.frames,
            width=g.width,
            height=g.height,
            route="stream",
            threads=self.threads,
            encode_ms=encode_ms,
        )

    def abort(self) -> None:
        """Kill ffmpeg and remove whatever it wrote. Idempotent."""
        with contextlib.suppress(_Aborted):
            self._stack.__exit__(_Aborted, _Aborted("the stream was aborted"), None)

    def close(self) -> None:
        self.abort()
