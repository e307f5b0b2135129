"""Which ffmpeg runs, and what it says about itself."""

from __future__ import annotations

import functools
import subprocess

from framewire.client._errors import Unavailable


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
