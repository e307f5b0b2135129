"""Outputs that appear whole or not at all: write aside, fsync, rename.

ffmpeg writes into a private directory (mode 0700) made beside the output, and
names it through ``/proc/self/fd/<dir fd>``. The directory is reached through
an fd opened when it was made, never by path again, and nobody else can put a
file or a link inside it: a directory or link swapped in anywhere along the
output's path after the worker judged it cannot redirect the write. The
finished file is then renamed into the output directory, again by fd.

The private directory is ``flock``-ed while it is in use. The lock dies with
the process, even on SIGKILL, so a later worker can tell an abandoned one from
one that a live worker (maybe in another PID namespace, sharing the volume) is
still writing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import secrets
import stat
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal, Protocol

from framewire.core.beside import Beside
from framewire.core.errors import BadRequest, Conflict, FramewireError, MediaError, host_error
from framewire.core.shm import pid_alive

# Private directories carry this prefix and the writer's pid, so a restarted
# worker can tell its own leftovers (from a SIGKILL) from anybody else's files.
# Requests may not name a path component with this prefix (``paths``), so no
# request can make a directory the sweep would take for one, nor write into
# another request's. The output's name is not part of the directory's: a legal
# 255-byte file name must still fit.
TEMP_PREFIX = ".framewire-tmp-"
_TEMP_NAME = re.compile(re.escape(TEMP_PREFIX) + r"(\d+)-[0-9a-f]{16}")

# How far below an output root the startup sweep looks: outputs are usually a
# few directories deep, and a huge tree must not delay the start.
SWEEP_DEPTH = 4
SWEEP_MAX_DIRS = 10_000

# A directory opened as itself, never through a symlink.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# The directory of an output written where its follower says (a memory output's memfd):
# none, so nothing is made, claimed or removed in any.
NO_DIRECTORY = -1


def temp_name() -> str:
    return f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"


@dataclass(frozen=True)
class TempOutput:
    """Where an output is written before it is renamed into place."""

    fd: int  # the private directory: a child process must inherit it to use ``path``
    name: str  # the output's own name: ffmpeg picks the muxer from its extension

    @property
    def path(self) -> str:
        return f"/proc/self/fd/{self.fd}/{self.name}"

    @property
    def muxer(self) -> str | None:
        """The container's muxer where ``path`` does not name it by its extension."""
        return None

    def digest(self) -> tuple[int, str]:
        """Size and sha256 of what was written."""
        try:
            fd = os.open(self.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError as exc:
            raise changed("cannot read back the output") from exc
        with open(fd, "rb") as f:
            return sha256_of(f)

    def digest_inspected(
        self, inspect: Callable[[str], None] | None, follower: Follower | None = None
    ) -> tuple[int, str]:
        """``follower`` told the file is whole (a memory output is sealed and held then, a
        take waiting on it answers: sealing waits out any read of its pages in progress,
        up to 150 ms, so it comes before the hash's), then :meth:`digest`, and meanwhile
        ``inspect`` run on the file (the hash, on a thread of its own, releases the GIL:
        the two cost the encode's tail the longer of them, not their sum). Raises what
        the follower raised, else what the digest raised (as it did when it came first),
        else what ``inspect`` raised."""
        if inspect is None and follower is None:
            return self.digest()
        if follower is not None:
            follower.written(self)
        digested = Beside(self.digest, "framewire-digest")
        try:
            if inspect is not None:
                inspect(self.path)
        except Exception:
            digested.result()  # the digest's error first, as when it came first
            raise
        finally:
            digested.join()  # bounded: one read of a finished file; it must not outlive it
        return digested.result()


class Follower(Protocol):
    """What follows an output while it is written (an object's early upload:
    service/_store/early.py; a memory output's memfd: service/_store/memfile.py): asked
    where the encode writes (its own file, if it has one), told where the file is, asked
    between pieces of the encode whether to go on (it raises to stop it), told when the
    file is whole (beside its digest)."""

    def destination(self) -> TempOutput | None: ...

    def writing(self, temp: TempOutput) -> None: ...

    def check(self) -> None: ...

    def written(self, temp: TempOutput) -> None: ...


def sha256_of(f: BinaryIO) -> tuple[int, str]:
    """Bytes read from ``f`` to its end, and their sha256."""
    h = hashlib.sha256()
    while block := f.read(1 << 20):
        h.update(block)
    return f.tell(), h.hexdigest()


def _claim(directory: int) -> tuple[str, int]:
    """Make and lock a fresh private directory in ``directory``; returns its name and fd."""
    while True:
        temp = temp_name()
        os.mkdir(temp, 0o700, dir_fd=directory)
        fd = os.open(temp, DIR_FLAGS, dir_fd=directory)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            return temp, fd  # no locks on this filesystem: the pid in the name still tells
        try:
            if os.stat(temp, dir_fd=directory, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                return temp, fd
        except FileNotFoundError:
            pass
        os.close(fd)  # a sweeper removed it between mkdir and lock: take another name


def _empty(fd: int) -> bool:
    """Remove every file in the directory open at ``fd``; False if it holds a directory."""
    for entry in os.scandir(fd):
        if entry.is_dir(follow_symlinks=False):
            return False  # the worker makes none: not ours to judge
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.name, dir_fd=fd)
    return True


def _discard(directory: int, temp: str, fd: int) -> None:
    # Whatever ffmpeg wrote, not only the output: the private directory is ours alone.
    with contextlib.suppress(OSError):
        _empty(fd)
    with contextlib.suppress(OSError):  # moved away or filled by someone else: theirs now
        os.rmdir(temp, dir_fd=directory)


@contextlib.contextmanager
def atomic_output(directory: int, name: str, *, durable: bool = True) -> Iterator[TempOutput]:
    """Yield where to write ``name``; on success it is renamed into ``directory``.

    ``directory`` is an open directory fd that stays the caller's. On any
    exception the written file and the private directory are removed.
    ``durable``: the file and the rename are fsynced before this returns; not for
    the spool's files, read back from the page cache and worthless after a crash.
    """
    try:
        temp, fd = _claim(directory)
    except OSError as exc:
        raise _write_error(exc, "cannot create a file in the output directory") from exc
    try:
        yield TempOutput(fd, name)
        try:
            if durable:
                written = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                try:
                    os.fsync(written)
                finally:
                    os.close(written)
            # By fds on both sides: a link placed at the output's name is replaced, not followed.
            os.replace(name, name, src_dir_fd=fd, dst_dir_fd=directory)
        except OSError as exc:
            raise _write_error(exc, "cannot complete the output") from exc
    finally:
        _discard(directory, temp, fd)  # after the rename: only the empty directory
        os.close(fd)
    if durable:
        os.fsync(directory)


def refuse_directory(directory: int, path: Path) -> None:
    """Refuse (400) an output whose name in ``directory`` names a directory there; one
    with no directory (NO_DIRECTORY) has nothing to refuse."""
    if directory == NO_DIRECTORY:
        return
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.stat(path.name, dir_fd=directory, follow_symlinks=False).st_mode):
            raise BadRequest(f"output path {path} is a directory", code="output_is_directory")


@contextlib.contextmanager
def output_file(
    directory: int, name: str, *, durable: bool, follower: Follower | None
) -> Iterator[TempOutput]:
    """Where the encode writes ``name``: the follower's own file if it has one (a memory
    output's memfd, which stays the follower's), else :func:`atomic_output`'s."""
    own = None if follower is None else follower.destination()
    if own is not None:
        yield own
        return
    if directory == NO_DIRECTORY:
        raise FramewireError(f"{name}: an output with no directory has no file", code="internal")
    with atomic_output(directory, name, durable=durable) as temp:
        yield temp


def _write_error(exc: OSError, what: str) -> FramewireError:
    if exc.errno == errno.ENOENT:
        return changed(what)
    refused = MediaError(f"{what}: {exc.strerror}", code="output_not_writable")
    return host_error(exc, what) or refused


def changed(what: str) -> Conflict:
    """A name the worker holds by fd went missing: whoever may write in the output's
    directory removed or replaced it (a directory made for a request renamed over, or
    emptied and removed) after the worker opened it. A race with the caller's path,
    like a link swapped while it is resolved: never the worker's fault."""
    return Conflict(
        f"{what}: the output's directory was removed or replaced while the worker used it",
        code="path_changed",
    )


def open_directory(path: Path) -> int:
    """An fd for an existing directory (symlinks followed: for callers choosing their own path)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


# What the sweep did with a private directory: removed it; kept it (a live worker's,
# or not one of ours); or found its worker dead but its lock still held, by a child
# that worker started (an ffmpeg finishing on its closed stdin) or by a live writer in
# a PID namespace we cannot see.
Swept = Literal["removed", "kept", "held"]


def _remove_if_abandoned(path: Path) -> Swept:
    """Remove ``path`` if it is a private directory that nobody is writing any more."""
    found = _TEMP_NAME.fullmatch(path.name)
    if found is None:
        return "kept"
    pid = int(found.group(1))
    # Our own pid at startup is a previous worker's (pid reuse is the rule in containers).
    if pid != os.getpid() and pid_alive(pid):
        return "kept"
    try:
        fd = os.open(path, DIR_FLAGS | os.O_NONBLOCK)
    except OSError:
        return "kept"  # a symlink, not a directory, or gone already
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
            return "kept"  # not made by a worker of ours: someone else's look-alike
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "held"
        except OSError:
            pass  # no locks on this filesystem: the dead pid is all there is to go on
        # Under our lock: a writer racing us sees it gone and takes a new name.
        if not _empty(fd):
            return "kept"
        os.rmdir(path)
        return "removed"
    except OSError:
        return "kept"
    finally:
        os.close(fd)


def remove_stale_temps(
    roots: list[str],
    *,
    depth: int = SWEEP_DEPTH,
    max_dirs: int = SWEEP_MAX_DIRS,
    held: list[Path] | None = None,
) -> list[Path]:
    """Remove private directories that killed workers left under ``roots``; returns them.

    Only names this module makes, only directories holding no directory, only
    when their writer's pid is not alive and nobody holds their lock.
    Directories are walked breadth-first, at most ``depth`` levels below a root
    and ``max_dirs`` in all; symlinks are not followed. Those whose writer is dead
    but whose lock is still held go to ``held``, for ``remove_released``.
    """
    found: list[Path] = []
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
                found.append(Path(entry.path))
            elif level < depth:
                with contextlib.suppress(OSError):
                    if entry.is_dir(follow_symlinks=False):
                        queue.append((Path(entry.path), level + 1))
    removed, still = remove_released(found)
    if held is not None:
        held += still
    return removed


def remove_released(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """Of ``paths`` (private directories, the ``held`` ones of ``remove_stale_temps``):
    those removed now that nobody holds them, and those still held (a directory kept,
    or gone meanwhile, is neither)."""
    removed, still = [], []
    for path in paths:
        swept = _remove_if_abandoned(path)
        if swept == "removed":
            removed.append(path)
        elif swept == "held":
            still.append(path)
    return removed, still
