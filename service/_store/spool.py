"""Where an output bound for object storage is encoded before it is uploaded.

The spool is ``.framewire-tmp-spool`` in the first output root: the disk the
operator sized for outputs, never nameable by a request (paths may not use the
``.framewire-tmp-`` prefix), and skipped by the sweep of private directories.
An output is encoded exactly as a file is (private directory, fsync, validate,
rename) to ``<pid>-<hex><ext>`` here, uploaded, and removed whatever happened.
What a killed worker left here is removed at the next start (:func:`sweep`).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from pathlib import Path

from framewire.core.errors import Unavailable
from framewire.core.shm import pid_alive
from framewire.service._access.paths import real_roots
from framewire.service._outputs import TEMP_PREFIX, remove_stale_temps

SPOOL = TEMP_PREFIX + "spool"
_SPOOLED = re.compile(r"(\d+)-[0-9a-f]{16}\.[a-z0-9]+")


def spool_dir(roots: list[str]) -> Path:
    return Path(real_roots(roots)[0]) / SPOOL


def spool_path(roots: list[str], suffix: str) -> Path:
    """A fresh name in the spool (made, mode 0700, if missing) for one output."""
    directory = spool_dir(roots)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise Unavailable(
            f"cannot make the upload spool in the first output root ({exc.strerror})",
            code="output_root_missing",
        ) from exc
    return directory / f"{os.getpid()}-{secrets.token_hex(8)}{suffix}"


def discard(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def sweep(roots: list[str]) -> list[Path]:
    """Remove spooled files and private directories whose worker is gone; returns them."""
    directory = spool_dir(roots)
    if not roots or not directory.is_dir():
        return []
    removed = remove_stale_temps([str(directory)], depth=0)
    for entry in os.scandir(directory):
        found = _SPOOLED.fullmatch(entry.name)
        if found is None or not entry.is_file(follow_symlinks=False):
            continue
        pid = int(found.group(1))
        if pid == os.getpid() or not pid_alive(pid):  # our pid at start: a previous worker's
            discard(Path(entry.path))
            removed.append(Path(entry.path))
    return removed
