"""The reference decode of DESIGN §4, run straight into a sealed memfd.

The worker and the client's local fallback both decode through :class:`DecodeRun`,
so a rank gets the same bytes (and the same checks) whichever way it got them.
ffmpeg writes rgb24 into the memfd through an inherited descriptor, so no pipe
and no copy sit between it and the pages that ranks will map.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import BadRequest, MediaError, NotFound, Unavailable
from .ffmpeg_argv import decode_argv, resolve_ffmpeg
from .wire import DecodeRequest

MEMFD_NAME = "framewire-decode"
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
STDERR_TAIL = 4096


def find_ffmpeg() -> str:
    """FRAMEWIRE_FFMPEG, else imageio-ffmpeg's binary: the worker's choice too."""
    return resolve_ffmpeg(os.environ.get("FRAMEWIRE_FFMPEG"))


@dataclass(frozen=True)
class Decoded:
    """A finished decode. ``fd`` is a sealed memfd of ``byte_size`` bytes, owned by the caller."""

    fd: int
    frames: int
    byte_size: int
    decode_ms: float


class DecodeRun:
    """One ffmpeg decode in flight; :meth:`wait` hands over the sealed memfd.

    ``max_bytes`` bounds what the decode may hold. It is ffmpeg's file-size limit
    (RLIMIT_FSIZE, set as it starts), so the kernel stops a decode at the bound,
    whatever the file's length, without a word of the byte-exact argv changing.
    :meth:`kill` may be called from another thread (worker shutdown); the run
    then fails with ``decode_failed``.
    """

    def __init__(
        self,
        ffmpeg: str,
        path: str | os.PathLike[str],
        request: DecodeRequest,
        *,
        max_bytes: int | None = None,
    ):
        self.request = request
        self.path = os.fspath(path)
        self.max_bytes = max_bytes
        if max_bytes is not None and request.frame_bytes > max_bytes:
            raise self._too_large()
        self._out = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self._err = -1
        try:
            # stderr into a file, not a pipe: ffmpeg can never block on it.
            self._err = os.memfd_create("framewire-ffmpeg-stderr", os.MFD_CLOEXEC)
            argv = decode_argv(
                ffmpeg,
                path=path,
                fps=request.fps,
                width=request.width,
                height=request.height,
                start=request.start,
                max_frames=request.max_frames,
                out_fd=self._out,
            )
            self._started = time.perf_counter()
            # pass_fds: the child inherits the memfd at the same number, so pipe:N
            # names it; a fresh memfd's offset is 0 and write() appends from there.
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self._err,
                pass_fds=(self._out,),
                close_fds=True,
            )
            if max_bytes is not None:
                # Set before ffmpeg has opened its input, let alone written a frame. If
                # it cannot be set (ffmpeg gone already, a sandbox that forbids it),
                # wait() still refuses a decode past the bound.
                with contextlib.suppress(OSError):
                    limit = (max_bytes, max_bytes)
                    resource.prlimit(self.proc.pid, resource.RLIMIT_FSIZE, limit)
        except OSError as exc:
            self._close_fds()
            raise Unavailable(
                f"cannot run ffmpeg {ffmpeg!r}: {exc.strerror or exc}", code="ffmpeg_missing"
            ) from exc
        except BaseException:
            self._close_fds()
            raise

    def wait(self) -> Decoded:
        """Wait for ffmpeg, check what it wrote, seal it and hand it over."""
        try:
            rc = self.proc.wait()
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
            fd, self._out = self._out, -1
            return Decoded(fd, size // frame_bytes, size, decode_ms)
        finally:
            self.close()

    def _too_large(self) -> BadRequest:
        r = self.request
        return BadRequest(
            f"decoding {self.path} at {r.width}x{r.height} and {r.fps:g} fps needs more than "
            f"{self.max_bytes} bytes (FRAMEWIRE_MAX_DECODE_BYTES): ask for fewer frames "
            "(max_frames), a smaller size or a lower fps",
            code="decode_too_large",
        )

    def _failure(self, why: str) -> MediaError:
        tail = self.stderr_tail()
        last = tail.splitlines()[-1] if tail else ""
        message = f"cannot decode {self.path}: {why}" + (f": {last}" if last else "")
        return MediaError(message, code="decode_failed", detail=tail or None)

    def stderr_tail(self, limit: int = STDERR_TAIL) -> str:
        if self._err < 0:
            return ""
        size = os.fstat(self._err).st_size
        start = max(0, size - limit)
        return os.pread(self._err, size - start, start).decode("utf-8", "replace").strip()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    def close(self) -> None:
        """Kill if still running, reap, release what was not handed over. Idempotent."""
        self.kill()
        self.proc.wait()
        self._close_fds()

    def _close_fds(self) -> None:
        for name in ("_out", "_err"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


def decode_to_memfd(ffmpeg: str, path: str | os.PathLike[str], request: DecodeRequest) -> Decoded:
    """Decode ``path`` (which must be a regular file) into a sealed memfd."""
    # Absolute, so that no name can be read by ffmpeg as an option or a protocol.
    path = os.path.abspath(path)
    if not Path(path).is_file():
        raise NotFound(f"reference video {path!r} does not exist", code="not_found")
    return DecodeRun(ffmpeg, path, request).wait()
