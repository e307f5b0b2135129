"""Outputs that appear whole or not at all: write beside, fsync, rename."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

# Temp names carry this prefix and the writer's pid, so a restarted worker can
# tell its own leftovers (from a SIGKILL) from anybody else's files.
TEMP_PREFIX = ".framewire-tmp-"


def temp_path_for(path: Path) -> Path:
    # The target's name stays at the end: ffmpeg picks the muxer from the extension.
    return path.with_name(f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{path.name}")


def fsync_path(path: Path, *, directory: bool = False) -> None:
    fd = os.open(path, (os.O_RDONLY | os.O_DIRECTORY) if directory else os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success it becomes ``path``, else it is removed."""
    tmp = temp_path_for(path)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent, directory=True)
