"""Which encoder made an output's bytes: the identity an engine asks the worker for.

The same argv and frames give other bytes with another ffmpeg or libx264 build
(DESIGN 3.1.1), so an encoder is named by what it is, not by where it lies: an
ffmpeg binary by the sha256 of its file, PyAV by its version (its wheel bundles
its own libavcodec and libx264). Both the worker (what it can run) and a caller
(what its engine would have run) compute the names here.
"""

from __future__ import annotations

import functools
import hashlib
import os

FFMPEG = "ffmpeg-sha256:"
PYAV = "pyav:"


def ffmpeg_identity(exe: str | os.PathLike[str]) -> str:
    """``ffmpeg-sha256:<hex>`` of the executable at ``exe`` (symlinks followed)."""
    real = os.path.realpath(exe)
    st = os.stat(real)
    return FFMPEG + _file_sha256(
        real, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    )


@functools.lru_cache(maxsize=64)
def _file_sha256(path: str, status: tuple[int, ...]) -> str:
    # Keyed by the file's status too: another file renamed over it (another inode) or a
    # write into it (a new ctime, which no one can set back) is hashed again.
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def pyav_identity(version: str) -> str:
    """``pyav:<version>``: PyAV's wheels bundle their FFmpeg and x264 builds."""
    return PYAV + version


def is_identity(value: str) -> bool:
    """Whether ``value`` is spelled as an encoder identity (its kind and a name)."""
    return any(value.startswith(p) and len(value) > len(p) for p in (FFMPEG, PYAV))
