"""The reference decode (docs/byte-exactness.md), run straight into a sealed memfd.

The worker and the client's local fallback both decode through :class:`DecodeRun`,
so a rank gets the same bytes (and the same checks) whichever way it got them.
ffmpeg writes rgb24 into the memfd through an inherited descriptor, so no pipe
and no copy sit between it and the pages that ranks will map.
"""

from __future__ import annotations

import fcntl
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from framewire.core.errors import BadRequest, FramewireError, MediaError
from framewire.core.media.argv import decode_argv, refused_input
from framewire.core.media.inputs import InputFile
from framewire.core.media.process import FfmpegProcess
from framewire.core.wire import DecodeRequest

MEMFD_NAME = "framewire-decode"
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
STDERR_TAIL = 4096


@dataclass(frozen=True)
class Decoded:
    """A finished decode. ``fd`` is a sealed memfd of ``byte_size`` bytes, owned by the caller."""

    fd: int
    frames: int
    byte_size: int
    decode_ms: float


class DecodeRun:
    """One ffmpeg decode in flight; :meth:`wait` hands over the sealed memfd.

    ``source`` is the open reference video (read by ffmpeg through its fd: the
    file judged is the file decoded). ``max_bytes`` bounds what the decode may
    hold. It is ffmpeg's file-size limit (RLIMIT_FSIZE, set as it starts), so
    the kernel stops a decode at the bound, whatever the file's length, without
    a word of the byte-exact argv changing. ``stall_s``: a decode that makes no
    progress this long is killed (:class:`Stalled`). :meth:`kill` may be called
    from another thread (worker shutdown); the run then fails with ``decode_failed``,
    and so may :meth:`frames_written` (a progress display).
    """

    def __init__(
        self,
        ffmpeg: str,
        source: InputFile,
        request: DecodeRequest,
        *,
        max_bytes: int | None = None,
        stall_s: float | None = None,
    ):
        self.request = request
        self.path = source.name
        self.max_bytes = max_bytes
        if max_bytes is not None and request.frame_bytes > max_bytes:
            raise self._too_large()
        # The memfd's size, read by frames_written from another thread: the lock keeps
        # it from reading a descriptor number that was closed (and perhaps reused).
        self._out_lock = threading.Lock()
        self._written = 0
        self._out = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            argv = decode_argv(ffmpeg, request, path=source.ffmpeg_path, out_fd=self._out)
            self._started = time.perf_counter()
            # pass_fds: the child inherits the memfd at the same number, so pipe:N
            # names it; a fresh memfd's offset is 0 and write() appends from there.
            self.ff = FfmpegProcess(
                argv,
                stdin=False,
                pass_fds=(self._out, source.fd),
                stall_s=stall_s,
                file_size_limit=max_bytes,
            )
        except BaseException:
            self._close_out()
            raise

    def wait(self) -> Decoded:
        """Wait for ffmpeg, check what it wrote, seal it and hand it over."""
        try:
            rc = self.ff.wait()
            decode_ms = (time.perf_counter() - self._started) * 1e3
            size = os.fstat(self._out).st_size
            frame_bytes = self.request.frame_bytes
            if self.max_bytes is not None and (
                rc == -signal.SIGXFSZ or size > self.max_bytes or (rc and size == self.max_bytes)
            ):
                raise self._too_large()
            if rc != 0:
                why = f"ffmpeg exited {rc}" if rc > 0 else f"ffmpeg was killed (signal {-rc})"
                raise self._failure(why)
            if size == 0:
                raise self._failure("ffmpeg produced no frames")
            if size % frame_bytes:
                raise self._failure(
                    f"ffmpeg wrote {size} bytes, not a whole number of "
                    f"{self.request.width}x{self.request.height} rgb24 frames"
                )
            fcntl.fcntl(self._out, fcntl.F_ADD_SEALS, SEALS)
            with self._out_lock:
                fd, self._out, self._written = self._out, -1, size
            return Decoded(fd, size // frame_bytes, size, decode_ms)
        finally:
            self.close()

    def frames_written(self) -> int:
        """Whole frames ffmpeg has written into the memfd so far: the decode's progress,
        as the kernel counts it (the memfd's size). Safe from any thread."""
        with self._out_lock:
            if self._out >= 0:
                self._written = os.fstat(self._out).st_size
            return self._written // self.request.frame_bytes

    def _too_large(self) -> BadRequest:
        r = self.request
        return BadRequest(
            f"decoding {self.path} at {r.width}x{r.height} and {r.fps:g} fps needs more than "
            f"{self.max_bytes} bytes (FRAMEWIRE_MAX_DECODE_BYTES): ask for fewer frames "
            "(max_frames), a smaller size or a lower fps",
            code="decode_too_large",
        )

    def _failure(self, why: str) -> FramewireError:
        tail = self.ff.stderr_tail()
        last = tail.splitlines()[-1] if tail else ""
        message = f"cannot decode {self.path}: {why}" + (f": {last}" if last else "")
        if refused_input(tail):
            return BadRequest(
                f"{self.path} is not a video file of an allowed format: playlists, "
                "concat lists and image sequences are not decoded",
                code="input_format_refused",
                detail=tail,
            )
        return MediaError(message, code="decode_failed", detail=tail or None)

    def stderr_tail(self, limit: int = STDERR_TAIL) -> str:
        return self.ff.stderr_tail(limit)

    def kill(self) -> None:
        self.ff.kill()

    def close(self) -> None:
        """Kill if still running, reap, release what was not handed over. Idempotent."""
        self.ff.close()
        self._close_out()

    def _close_out(self) -> None:
        with self._out_lock:
            if self._out >= 0:
                os.close(self._out)
                self._out = -1


def decode_to_memfd(
    ffmpeg: str,
    path: str | os.PathLike[str],
    request: DecodeRequest,
    *,
    started: Callable[[DecodeRun], None] | None = None,
) -> Decoded:
    """Decode the regular file at ``path`` into a sealed memfd; ``started`` is given the
    run once ffmpeg runs (to watch :meth:`DecodeRun.frames_written`)."""
    with InputFile.open(os.path.abspath(path)) as source:
        run = DecodeRun(ffmpeg, source, request)
        if started is not None:
            started(run)
        return run.wait()
