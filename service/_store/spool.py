"""Where an object or memory output is encoded before it is uploaded or held.

The spool is a directory of the worker's in the first output root: the disk the
operator sized for outputs, never nameable by a request (paths may not use the
``.framewire-tmp-`` prefix), and skipped by the sweep of private directories.
An output is encoded as a file is (private directory, validate, rename) to
``<pid>-<hex><ext>`` there, uploaded or held, and removed whatever happened; it is
not fsynced (its bytes are read back from the page cache at once, and a crash loses
the spool whatever its state). What a killed worker left is removed at the next
start (:func:`sweep`).

Whoever may write the output root could make the spool's name first, or swap it: a
directory of theirs would let them read every output and change a finished file
before its upload, a file would refuse every object output. So each worker makes its
own, under a name no one can guess before it exists (``.framewire-tmp-spool-<pid>-<hex>``,
made with ``mkdir``, which fails on anything already there), checks through the open
directory that it is a directory of the worker's closed to everyone else (mode 0700),
and from then on reaches it only through that descriptor, which it keeps: a name
taken first costs another try, never a refusal, and a rename changes nothing.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import stat
import threading
from pathlib import Path

from framewire.core.errors import Unavailable
from framewire.core.shm import pid_alive
from framewire.service._access.paths import real_roots
from framewire.service._outputs import DIR_FLAGS, TEMP_PREFIX, remove_stale_temps

SPOOL = TEMP_PREFIX + "spool"  # and "-<pid>-<hex>"; a bare one is an older worker's
_SPOOL_NAME = re.compile(re.escape(SPOOL) + r"(?:-(\d+)-[0-9a-f]{16})?")
_SPOOLED = re.compile(r"(\d+)-[0-9a-f]{16}\.[a-z0-9]+")
MAKE_TRIES = 8  # names taken first (by a user racing the mkdir) before giving up

log = logging.getLogger("framewire.store")


class Spool:
    """The worker's spool, made when first needed and held open for the worker's life."""

    def __init__(self, roots: list[str]):
        self.roots = roots
        self._fd = -1
        self.path: Path | None = None  # where it was made (for messages; never reopened)
        self._lock = threading.Lock()

    def open(self) -> int:
        """A descriptor of the spool (the caller's to close): the one held, or, where none
        is or the one held was removed, a new one made. Raises 503 ``output_root_missing``
        when the first output root cannot be opened or written, ``spool_not_private``
        when every name tried was taken first."""
        with self._lock:
            if self._fd >= 0 and os.fstat(self._fd).st_nlink == 0:  # removed under it
                os.close(self._fd)
                self._fd = -1
            if self._fd < 0:
                self._fd, self.path = _make(real_roots(self.roots)[0])
            return os.dup(self._fd)

    def file(self, suffix: str) -> Path:
        """A fresh name for one output (the spool made if missing), as messages show it."""
        os.close(self.open())
        assert self.path is not None
        return self.path / f"{os.getpid()}-{secrets.token_hex(8)}{suffix}"

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _make(root: str) -> tuple[int, Path]:
    try:
        parent = os.open(root, DIR_FLAGS)
    except OSError as exc:
        raise Unavailable(
            f"cannot open the first output root for the upload spool ({exc.strerror})",
            code="output_root_missing",
        ) from exc
    try:
        for _ in range(MAKE_TRIES):
            name = f"{SPOOL}-{os.getpid()}-{secrets.token_hex(8)}"
            try:
                os.mkdir(name, 0o700, dir_fd=parent)
                fd = os.open(name, DIR_FLAGS | os.O_NONBLOCK, dir_fd=parent)
            except FileExistsError:
                continue
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                    continue  # swapped between the mkdir and the open
                raise Unavailable(
                    f"cannot make the upload spool in the first output root ({exc.strerror})",
                    code="output_root_missing",
                ) from exc
            if _own(os.fstat(fd)):
                return fd, Path(root) / name
            os.close(fd)  # another's, swapped in for the one made: try another name
    finally:
        os.close(parent)
    raise Unavailable(
        f"every name tried for the upload spool in {root} was taken first ({MAKE_TRIES} "
        "tries): another user is racing the worker in its output root",
        code="spool_not_private",
    )


def _own(st: os.stat_result) -> bool:
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def discard(directory: int, name: str) -> None:
    """Remove ``name`` from the spool open at ``directory``."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=directory)


def sweep(roots: list[str]) -> list[Path]:
    """Remove what workers that are gone left in their spools (spooled files, private
    directories, then the spool itself); returns what went. A spool's name that is not a
    directory of the worker's own is left as it is (and said in the log)."""
    if not roots:
        return []
    root = real_roots(roots)[0]
    try:
        parent = os.open(root, DIR_FLAGS)
    except OSError:
        return []
    removed: list[Path] = []
    try:
        for entry in os.scandir(parent):
            found = _SPOOL_NAME.fullmatch(entry.name)
            if found is not None:
                pid = None if found.group(1) is None else int(found.group(1))
                removed += _sweep_spool(parent, Path(root) / entry.name, pid)
    finally:
        os.close(parent)
    return removed


def _sweep_spool(parent: int, shown: Path, pid: int | None) -> list[Path]:
    try:
        fd = os.open(shown.name, DIR_FLAGS | os.O_NONBLOCK, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a link, a file, a device
            log.warning("%s is not the worker's own (not a directory): left alone", shown)
        return []
    try:
        st = os.fstat(fd)
        if not _own(st):
            why = f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}"
            log.warning("%s is not the worker's own (%s): left alone", shown, why)
            return []
        # Through the fd, never the name again: whatever is renamed into the root meanwhile.
        removed = [shown / p.name for p in remove_stale_temps([f"/proc/self/fd/{fd}"], depth=0)]
        for entry in os.scandir(fd):
            found = _SPOOLED.fullmatch(entry.name)
            if found is None or not entry.is_file(follow_symlinks=False):
                continue
            if _gone(int(found.group(1))):
                discard(fd, entry.name)
                removed.append(shown / entry.name)
    finally:
        os.close(fd)
    if pid is None or _gone(pid):  # an older worker's, or a gone one's: empty now, or kept
        with contextlib.suppress(OSError):
            os.rmdir(shown.name, dir_fd=parent)
            removed.append(shown)
    return removed


def _gone(pid: int) -> bool:
    """Whether the worker of ``pid`` is gone: our own pid at the start was a previous
    worker's (a container's first process has the same pid each time)."""
    return pid == os.getpid() or not pid_alive(pid)
