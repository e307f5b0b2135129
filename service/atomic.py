"""Outputs that appear whole or not at all: write beside, fsync, rename.

A temp file is created and ``flock``-ed by the worker before ffmpeg writes it,
and stays locked until it is renamed or removed. The lock dies with the
process, even on SIGKILL, so a later worker can tell an abandoned temp file
from one a live worker (maybe in another PID namespace, sharing the volume) is
still writing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import stat
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from framewire.client.errors import MediaError

# Temp names carry this prefix and the writer's pid, so a restarted worker can
# tell its own leftovers (from a SIGKILL) from anybody else's files.
TEMP_PREFIX = ".framewire-tmp-"
_TEMP_NAME = re.compile(re.escape(TEMP_PREFIX) + r"(\d+)-[0-9a-f]{8}-.+", re.DOTALL)

# How far below an output root the startup sweep looks: outputs are usually a
# few directories deep, and a huge tree must not delay the start.
SWEEP_DEPTH = 4
SWEEP_MAX_DIRS = 10_000


def temp_path_for(path: Path) -> Path:
    # The target's name stays at the end: ffmpeg picks the muxer from the extension.
    return path.with_name(f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{path.name}")


def fsync_path(path: Path, *, directory: bool = False) -> None:
    fd = os.open(path, (os.O_RDONLY | os.O_DIRECTORY) if directory else os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _claim_temp(path: Path) -> tuple[Path, int]:
    """Create and lock a fresh temp file beside ``path``; returns it and the lock's fd."""
    while True:
        tmp = temp_path_for(path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            return tmp, fd  # no locks on this filesystem: the pid in the name still tells
        try:
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                return tmp, fd
        except FileNotFoundError:
            pass
        os.close(fd)  # a sweeper removed it between create and lock: take another name


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success it becomes ``path``, else it is removed."""
    try:
        tmp, lock = _claim_temp(path)
    except OSError as exc:
        raise MediaError(
            f"cannot create a file in {path.parent}: {exc.strerror}", code="output_not_writable"
        ) from exc
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(lock)
    fsync_path(path.parent, directory=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # somebody else's process
    return True


def _remove_if_abandoned(path: Path) -> bool:
    """Remove ``path`` if it is a framewire temp file that nobody is writing any more."""
    found = _TEMP_NAME.fullmatch(path.name)
    if found is None:
        return False
    pid = int(found.group(1))
    # Our own pid at startup is a previous worker's (pid reuse is the rule in containers).
    if pid != os.getpid() and _alive(pid):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # a symlink, or gone already
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live writer whose pid we cannot see holds it
        except OSError:
            pass  # no locks on this filesystem: the dead pid is all there is to go on
        path.unlink()  # under our lock: a writer racing us sees it gone and takes a new name
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def remove_stale_temps(
    roots: list[str], *, depth: int = SWEEP_DEPTH, max_dirs: int = SWEEP_MAX_DIRS
) -> list[Path]:
    """Remove temp files that killed workers left under ``roots``; returns what went.

    Only names this module makes, only regular files, only when their writer's
    pid is not alive and nobody holds their lock. Directories are walked
    breadth-first, at most ``depth`` levels below a root and ``max_dirs`` in
    all; symlinks are not followed.
    """
    removed: list[Path] = []
    queue = deque((Path(root), 0) for root in roots)
    seen: set[tuple[int, int]] = set()
    while queue and len(seen) < max_dirs:
        directory, level = queue.popleft()
        try:
            st = os.stat(directory)
            if (st.st_dev, st.st_ino) in seen:
                continue  # nested or repeated roots
            seen.add((st.st_dev, st.st_ino))
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            if entry.name.startswith(TEMP_PREFIX):
                if _remove_if_abandoned(Path(entry.path)):
                    removed.append(Path(entry.path))
            elif level < depth:
                with contextlib.suppress(OSError):
                    if entry.is_dir(follow_symlinks=False):
                        queue.append((Path(entry.path), level + 1))
    return removed
