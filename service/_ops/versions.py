"""Which ffmpeg runs, and what it says about itself."""

from __future__ import annotations

import functools

from framewire.core.errors import FramewireError, Unavailable
from framewire.core.media.process import FfmpegProcess

VERSION_STALL_S = 10.0  # ``-version`` takes milliseconds; a binary that hangs is not ready


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


@functools.cache
def ffmpeg_version(exe: str) -> str:
    """:func:`version_line`, asked once per executable."""
    return version_line(exe)


def ffmpeg_runs(exe: str) -> bool:
    """Whether ``exe -version`` runs now (the readiness check: not cached)."""
    try:
        version_line(exe)
    except Unavailable:
        return False
    return True
