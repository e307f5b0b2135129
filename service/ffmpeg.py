"""Which ffmpeg runs, and what it says about itself."""

from __future__ import annotations

import functools
import subprocess

from framewire.client.errors import Unavailable
from framewire.client.ffmpeg_argv import resolve_ffmpeg as resolve_ffmpeg  # shared resolver
from framewire.client.ffmpeg_proc import FfmpegExited as FfmpegExited
from framewire.client.ffmpeg_proc import FfmpegProcess as FfmpegProcess
from framewire.client.ffmpeg_proc import kill_running as kill_running


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
