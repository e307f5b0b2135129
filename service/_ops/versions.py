"""Which ffmpeg runs, and what it says about itself."""

from __future__ import annotations

import functools
import threading
import time

from framewire.core.errors import FramewireError, Unavailable
from framewire.core.media.process import FfmpegProcess

VERSION_STALL_S = 10.0  # ``-version`` takes milliseconds; a binary that hangs is not ready
# How long a "runs" answer holds: readiness probes, scrapes and encodes all read it, so
# a flood of them starts one ``-version`` per binary this often, not one each.
RUNS_TTL_S = 2.0


def version_line(exe: str) -> str:
    """First line of ``ffmpeg -version``; raises Unavailable when it does not run."""
    try:
        with FfmpegProcess(
            [exe, "-hide_banner", "-version"], stdin=False, stdout=True, stall_s=VERSION_STALL_S
        ) as ff:
            rc = ff.wait()
            out = ff.stdout_text()
    except FramewireError as exc:  # cannot be started, or stalled
        raise Unavailable(
            f"ffmpeg {exe!r} does not run: {exc.message}", code="ffmpeg_missing"
        ) from exc
    if rc != 0 or not out:
        raise Unavailable(f"ffmpeg {exe!r} exited {rc}", code="ffmpeg_missing")
    return out.splitlines()[0]


@functools.lru_cache(maxsize=64)
def ffmpeg_version(exe: str, identity: str = "") -> str:
    """:func:`version_line`, asked once per executable (and ``identity``: a descriptor's
    name, ``/proc/self/fd/N``, may later hold another binary)."""
    return version_line(exe)


class RunCheck:
    """Whether a binary runs now (its ``-version``), asked at most once per
    :data:`RUNS_TTL_S` and one ask at a time: whoever comes while one is asked takes the
    last answer rather than starting another."""

    def __init__(self, exe: str, ttl_s: float = RUNS_TTL_S):
        self.exe = exe
        self.ttl_s = ttl_s
        self.why = ""  # why it does not run, when it does not
        self._ok = False
        self._at: float | None = None  # when last asked
        self._asking = threading.Lock()

    def fresh(self) -> bool | None:
        """The answer while it holds, else None (answering it needs :meth:`runs`)."""
        at = self._at
        if at is None or time.monotonic() - at >= self.ttl_s:
            return None
        return self._ok

    def runs(self, *, again: bool = False) -> bool:
        """Whether it runs (blocks on a ``-version`` at most once per ``ttl_s``).
        ``again``: ask now whatever the last answer (a run of it just failed)."""
        answer = None if again else self.fresh()
        if answer is not None:
            return answer
        # Only the first ask ever, or one asked again, waits on one in flight.
        if not self._asking.acquire(blocking=again or self._at is None):
            return self._ok
        try:
            answer = None if again else self.fresh()
            if answer is None:
                try:
                    version_line(self.exe)
                    self._ok, self.why = True, ""
                except Unavailable as exc:
                    self._ok, self.why = False, exc.message
                self._at = time.monotonic()
            return self._ok
        finally:
            self._asking.release()
