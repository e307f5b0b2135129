"""An encoder's or decoder's executable as the worker runs it: trusted only as far as its
file is, run from the very descriptor its identity was hashed from.

A binary's identity (``ffmpeg-sha256:<hex>``) names the bytes a request asks for. Two
things would break that promise: another user changing the file (or renaming another
over it, through any directory above it), and the worker hashing one file and running
another. So a binary is refused unless the file and every directory above it belong to
root or the worker's user and no other user may write to them (a sticky directory, where
none may rename another's names, excepted); it is opened once, hashed from that
descriptor, and run as ``/proc/self/fd/N`` (the child inherits the descriptor): what runs
is the file that was hashed even after its path names another, or nothing. Its identity
is hashed again whenever the file's status changed (a write changes its ctime, which no
one can set back), so it is never stale.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import weakref
from collections.abc import Collection
from pathlib import Path

from framewire.core.errors import Forbidden
from framewire.core.media.identity import FFMPEG

FD_EXE = "/proc/self/fd/"


def untrusted(path: str, owners: Collection[int]) -> str | None:
    """Why the file at ``path`` (its real path) could be changed by a user not in
    ``owners``; None when it cannot."""
    real = Path(os.path.realpath(path))
    for part in [real, *real.parents]:
        try:
            st = os.lstat(part)
        except OSError as exc:
            return f"{part}: {exc.strerror}"
        mode = stat.S_IMODE(st.st_mode)
        who = f"{part} (owner uid {st.st_uid}, mode {mode:o})"
        if st.st_uid not in owners:
            return f"{who} belongs to another user"
        sticky = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky:
            return f"{who} is writable by users other than its owner"
    return None


class Binary:
    """An executable opened once; run it as :attr:`exe`."""

    def __init__(self, path: str, owners: Collection[int] | None = None):
        """``owners``: the uids that may own it and the directories above it (root and
        this process's user by default)."""
        self.path = os.path.realpath(path)
        allowed = {0, os.getuid()} if owners is None else set(owners)
        why = untrusted(self.path, allowed)
        if why is not None:
            raise Forbidden(
                f"refusing the executable {path}: {why}; only root or uid {os.getuid()} may "
                "be able to change an encoder or decoder, and its directories",
                code="binary_not_trusted",
            )
        self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        self._closer = weakref.finalize(self, os.close, self.fd)  # one dropped unclosed
        self._lock = threading.Lock()
        self._key: tuple[int, int, int] | None = None
        self._sha256 = ""
        self.identity()

    @property
    def exe(self) -> str:
        """What a child runs: the descriptor, which it inherits (core/media/process.py)."""
        return f"{FD_EXE}{self.fd}"

    def identity(self) -> str:
        """``ffmpeg-sha256:<hex>`` of the bytes the descriptor holds now."""
        with self._lock:
            st = os.fstat(self.fd)
            key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if key != self._key:
                digest = hashlib.sha256()
                offset = 0
                while block := os.pread(self.fd, 1 << 20, offset):
                    digest.update(block)
                    offset += len(block)
                self._sha256, self._key = digest.hexdigest(), key
            return FFMPEG + self._sha256

    def close(self) -> None:
        self._closer()  # closes the descriptor once, however often it is called
        self.fd = -1


def exe_fd(argv0: str) -> int | None:
    """The descriptor a command runs from (``/proc/self/fd/N``), or None."""
    if argv0.startswith(FD_EXE) and argv0[len(FD_EXE) :].isdigit():
        return int(argv0[len(FD_EXE) :])
    return None
