"""Which ffmpeg runs, and what it says about itself."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import threading
from collections.abc import Callable

from framewire.client.errors import Unavailable
from framewire.client.ffmpeg_argv import resolve_ffmpeg as resolve_ffmpeg  # shared resolver


@functools.cache
def ffmpeg_version(exe: str) -> str:
    """First line of ``ffmpeg -version``; raises Unavailable when it does not run."""
    try:
        out = subprocess.run(
            [exe, "-hide_banner", "-version"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"ffmpeg {exe!r} does not run: {exc}", code="ffmpeg_missing") from exc
    if out.returncode != 0 or not out.stdout:
        raise Unavailable(f"ffmpeg {exe!r} exited {out.returncode}", code="ffmpeg_missing")
    return out.stdout.splitlines()[0]


class FfmpegExited(Exception):
    """ffmpeg stopped reading before it had every frame (it died or failed)."""


STDERR_TAIL = 4096
FINISH_POLL_S = 0.1

# Every ffmpeg child alive in this process, so a shutdown can stop them all at once.
_running: set[FfmpegProcess] = set()
_running_lock = threading.Lock()


def kill_running() -> int:
    """Kill every ffmpeg child still running (their owners clean up); returns how many."""
    with _running_lock:
        procs = list(_running)
    for ff in procs:
        ff.kill()
    return len(procs)


class FfmpegProcess:
    """One ffmpeg child with stdin as a pipe and stderr into a private memfd.

    stderr goes to a file rather than a pipe so ffmpeg can never block on it,
    whatever it prints, and no reader thread is needed.
    """

    def __init__(self, argv: list[str], *, pass_fds: tuple[int, ...] = ()):
        self.argv = argv
        self._stderr = os.memfd_create("framewire-ffmpeg-stderr", os.MFD_CLOEXEC)
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=self._stderr,
                close_fds=True,
                pass_fds=pass_fds,  # the output's private directory, named via /proc/self/fd
            )
        except OSError as exc:
            os.close(self._stderr)
            raise Unavailable(
                f"cannot run ffmpeg {argv[0]!r}: {exc.strerror}", code="ffmpeg_missing"
            ) from exc
        assert self.proc.stdin is not None
        self.stdin = self.proc.stdin
        with _running_lock:
            _running.add(self)

    def finish(self, check: Callable[[], None] = lambda: None) -> int:
        """Close stdin (end of frames) and wait for ffmpeg to write its trailer.

        x264's lookahead can hold many frames, so the flush after the last one may
        take seconds: ``check`` runs while waiting and may raise (cancellation);
        the caller's ``close`` then kills ffmpeg.
        """
        with contextlib.suppress(BrokenPipeError):
            self.stdin.close()
        while True:
            try:
                return self.proc.wait(timeout=FINISH_POLL_S)
            except subprocess.TimeoutExpired:
                check()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def stderr_tail(self, limit: int = STDERR_TAIL) -> str:
        size = os.fstat(self._stderr).st_size
        start = max(0, size - limit)
        return os.pread(self._stderr, size - start, start).decode("utf-8", "replace").strip()

    def close(self) -> None:
        """Kill if still running, reap, release the stderr memfd. Idempotent."""
        self.kill()
        with contextlib.suppress(OSError):
            self.stdin.close()
        self.proc.wait()
        with _running_lock:
            _running.discard(self)
        if self._stderr >= 0:
            os.close(self._stderr)
            self._stderr = -1

    def __enter__(self) -> FfmpegProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
