"""Which files the worker may write and read: everything under configured roots.

Paths are judged after resolving symlinks (``realpath``), so a link inside a
root that points outside it is refused like the outside path itself. ``..``
components are refused before any resolution: no legitimate caller needs them.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
import threading
from pathlib import Path

from framewire.core.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    MediaError,
    NotFound,
    Unavailable,
    host_error,
)
from framewire.core.media.argv import OUTPUT_EXTENSIONS
from framewire.core.media.inputs import InputFile
from framewire.service._access.peers import Peer
from framewire.service._outputs import DIR_FLAGS, TEMP_PREFIX, changed

RESOLVE_TRIES = 3


def _realpath(path: str | Path, raw: str) -> str:
    """``os.path.realpath``, which raises when a link on the path is swapped or removed
    while it reads it (between its ``lstat`` and ``readlink``): tried again, and a path
    that keeps changing under the worker is the caller's conflict, not the worker's."""
    for _ in range(RESOLVE_TRIES):
        try:
            return os.path.realpath(path)
        except OSError:
            continue
    raise Conflict(
        f"path {raw!r} changed while it was being resolved (a link on it replaced)",
        code="path_changed",
    )


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _root_of(path: str, roots: list[str]) -> str | None:
    """The real root that the real path ``path`` lies under; None if none."""
    return next((r for r in real_roots(roots) if _under(path, r)), None)


@functools.lru_cache(maxsize=64)
def _real_root(root: str) -> str:
    # Roots are configuration: resolved once, not on every request.
    return os.path.realpath(root)


def make_missing_roots(roots: list[str]) -> tuple[list[str], dict[str, str]]:
    """Make each of ``roots`` that is missing, as the worker's user makes any directory;
    returns those made, and why each that could not be was not (a read-only working
    directory, a file of that name). Only for roots left at their defaults: a root that
    was set must exist already (a mistyped path is not made)."""
    made: list[str] = []
    unmade: dict[str, str] = {}
    for root in roots:
        if not os.path.isdir(root):
            try:
                os.makedirs(root, mode=0o755, exist_ok=True)
            except OSError as exc:
                unmade[root] = exc.strerror or str(exc)
                continue
            made.append(root)
    return made, unmade


def real_roots(roots: list[str]) -> list[str]:
    """The roots as the paths this module judges against (symlinks resolved)."""
    return [_real_root(r) for r in roots]


def _no_dotdot(raw: str) -> None:
    if not raw or "\x00" in raw:
        raise BadRequest("empty path or NUL byte in path", code="bad_path")
    try:
        os.fsencode(raw)
    except UnicodeEncodeError as exc:  # lone surrogates from JSON "\udxxx" escapes
        raise BadRequest(f"path {raw!r} cannot be encoded", code="bad_path") from exc
    if ".." in Path(raw).parts:
        raise Forbidden(f"path {raw!r} contains '..'", code="path_traversal")


def resolve_output(raw: str, roots: list[str]) -> Path:
    """An output path under one of ``roots``; relative paths resolve against the first.

    Only judges the path: ``open_output_dir`` opens (and makes) its directory.
    """
    _no_dotdot(raw)
    if not roots:
        raise Forbidden("no output roots are configured", code="path_outside_roots")
    path = Path(raw) if os.path.isabs(raw) else Path(roots[0]) / raw
    if path.name in ("", ".", ".."):
        raise BadRequest(f"output path {raw!r} names no file", code="bad_path")
    parent = _realpath(path.parent, raw)
    root = _root_of(parent, roots)
    if root is None:
        raise Forbidden(
            f"output path {raw!r} is outside the output roots", code="path_outside_roots"
        )
    if any(part.startswith(TEMP_PREFIX) for part in Path(raw).parts):
        raise BadRequest(
            f"output path {raw!r}: names starting with {TEMP_PREFIX!r} are the worker's own",
            code="reserved_name",
        )
    if not path.name.lower().endswith(OUTPUT_EXTENSIONS):
        raise BadRequest(
            f"output path {raw!r}: the file must end in one of {', '.join(OUTPUT_EXTENSIONS)} "
            "(formats that write exactly one file)",
            code="unsupported_output_format",
        )
    target = Path(parent) / path.name
    try:
        _check_target(os.lstat(target).st_mode, raw)
    except FileNotFoundError:
        pass
    except OSError as exc:  # a name too long, or a "directory" that is a file
        if not os.path.isdir(root):  # the operator's to mend, not the caller's
            raise _root_missing(root, "not a directory") from exc
        raise BadRequest(f"output path {raw!r}: {exc.strerror}", code="bad_path") from exc
    return target


def _root_missing(root: str, why: str) -> Unavailable:
    return Unavailable(
        f"the output root {root!r} cannot be opened ({why}): it was removed or unmounted "
        "under the worker, or never made",
        code="output_root_missing",
    )


def _check_target(mode: int, raw: str) -> None:
    if stat.S_ISLNK(mode):
        raise Forbidden(f"output path {raw!r} is a symbolic link", code="path_outside_roots")
    if not stat.S_ISREG(mode):
        raise BadRequest(f"output path {raw!r} exists and is not a file", code="output_not_a_file")


def nearest_directory(directory: Path) -> Path:
    """``directory``, or its nearest ancestor that is one (where new ones would be made)."""
    while not directory.is_dir() and directory.parent != directory:
        directory = directory.parent
    return directory


def open_output_dir(
    target: Path, roots: list[str], made: list[Path] | None = None, peer: Peer | None = None
) -> int:
    """An fd for the directory of ``target`` (from ``resolve_output``), made if missing
    (and handed to ``peer``, the caller it is made for: ``_hand_over``).

    Opened one component at a time from the root, never following a symlink,
    so a directory swapped for a link since the path was judged is refused
    rather than followed. Writes then go through this fd (``atomic``). The
    directories made here, and those on the way that other requests in flight
    made, are appended to ``made`` (outermost first): a request that fails takes
    back those no other request uses any more (``remove_made``); one that
    succeeds lets go of them (``keep_made``).
    """
    parent = str(target.parent)
    root = _root_of(parent, roots)
    assert root is not None, "a target resolve_output judged lies under a root"
    try:
        fd = os.open(root, DIR_FLAGS)
    except OSError as exc:
        raise _root_missing(root, exc.strerror or str(exc)) from exc
    try:
        at = Path(root)
        for part in Path(parent).relative_to(root).parts:
            at = at / part
            with _users_lock:  # made or found, and held, before another lets go of it
                try:
                    child = os.open(part, DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    new = False
                    try:
                        os.mkdir(part, dir_fd=fd)
                        st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                        _hold(at, made, new=(st.st_dev, st.st_ino))
                        new = True
                    except FileExistsError:
                        pass
                    child = os.open(part, DIR_FLAGS, dir_fd=fd)
                    if new and peer is not None:
                        _hand_over(child, fd, peer)
                else:
                    _hold(at, made, new=None)
            os.close(fd)
            fd = child
        try:
            mode = os.stat(target.name, dir_fd=fd, follow_symlinks=False).st_mode
            _check_target(mode, str(target))
        except FileNotFoundError:
            pass
        return fd
    except OSError as exc:
        os.close(fd)
        if exc.errno == errno.ENOENT:  # a directory on the way removed between two steps
            raise changed(f"cannot open or make the output directory {parent!r}") from exc
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Forbidden(
                f"output directory {parent!r} changed to a link or a file after it was checked",
                code="path_outside_roots",
            ) from exc
        what = f"cannot open or make the output directory {parent!r}"
        raise host_error(exc, what) or MediaError(
            f"{what}: {exc.strerror}", code="output_not_writable"
        ) from exc
    except BaseException:
        os.close(fd)
        raise


def _hand_over(child: int, parent: int, peer: Peer) -> None:
    """A directory made for a caller is the caller's to use afterwards, as one it made
    itself would be: a root worker gives it to the caller's uid and primary group; any
    other takes the group and mode of the directory it was made in (where it may), so
    whoever could write there can write here too. Best effort: the request that made
    it writes through the worker's fd either way."""
    if peer.uid == os.geteuid():
        return  # the worker's own uid: it is the caller's already
    with contextlib.suppress(OSError):
        st = os.fstat(child)
        if st.st_uid != os.geteuid():
            return  # not the directory made here (one put in its place since): not ours
        if os.geteuid() == 0:
            os.fchown(child, peer.uid, peer.gid)
            return
        around = os.fstat(parent)
        if st.st_gid != around.st_gid:
            os.fchown(child, -1, around.st_gid)
        os.fchmod(child, stat.S_IMODE(around.st_mode))


# Directories requests made, and how many requests in flight use each: one made for a
# request that fails is removed (if empty) when the last request using it ends, not only
# when the one that made it does (its rmdir fails while another's temp file is there).
# Each is known by (device, inode) too: the one at its path when it is taken back may be
# another, put there since by whoever may write beside it, and that one is not the worker's.
_users: dict[Path, int] = {}
_made_as: dict[Path, tuple[int, int]] = {}
_users_lock = threading.Lock()


def _hold(at: Path, made: list[Path] | None, *, new: tuple[int, int] | None) -> None:
    """(Under ``_users_lock``.) ``made`` holds ``at`` if a request made it (``new``: the
    directory this request made there, by device and inode)."""
    if made is None:
        return
    if new is not None:
        _made_as[at] = new
    if new is not None or at in _users:
        _users[at] = _users.get(at, 0) + 1
        made.append(at)


def remove_made(made: list[Path]) -> None:
    """A request that failed lets go of the directories ``open_output_dir`` made or found
    made by others in flight; each one no request uses any more is removed if empty."""
    _let_go(made, remove=True)


def keep_made(made: list[Path]) -> None:
    """A request that succeeded lets go of them: its file is in them, they stay."""
    _let_go(made, remove=False)


def _let_go(made: list[Path], *, remove: bool) -> None:
    for path in reversed(made):  # innermost first
        with _users_lock:
            left = _users.get(path, 1) - 1
            if left > 0:
                _users[path] = left
                continue
            _users.pop(path, None)
            made_as = _made_as.pop(path, None)
            if remove:
                with contextlib.suppress(OSError):  # not empty: files of others are in it
                    st = os.stat(path, follow_symlinks=False)
                    if (st.st_dev, st.st_ino) == made_as:
                        os.rmdir(path)
    made.clear()


def resolve_input(raw: str, roots: list[str]) -> Path:
    """Where ``raw`` leads, if that is under one of ``roots`` (relative: against the first).

    Only judges the path: ``open_input`` opens it and judges what it opened.
    """
    _no_dotdot(raw)
    if not roots:
        raise Forbidden("no input roots are configured", code="path_outside_roots")
    path = Path(raw) if os.path.isabs(raw) else Path(roots[0]) / raw
    real = _realpath(path, raw)
    if not any(_under(real, r) for r in real_roots(roots)):
        raise Forbidden(f"input path {raw!r} is outside the input roots", code="path_outside_roots")
    if not os.path.lexists(real):
        raise NotFound(f"input file {raw!r} does not exist", code="not_found")
    return Path(real)


def open_input(raw: str, roots: list[str]) -> InputFile:
    """The regular file ``raw`` names under ``roots``, open for ffmpeg (or PyAV) to read.

    Judged by its path first, then by what was opened (``/proc/self/fd`` tells):
    a directory swapped for a link in between cannot lead the open outside the
    roots. FIFOs, devices and sockets are refused before they are opened.
    """
    real = resolve_input(raw, roots)
    opened = InputFile.open(real)
    try:
        actual = os.readlink(f"/proc/self/fd/{opened.fd}").removesuffix(" (deleted)")
    except OSError:
        actual = str(real)  # no /proc: the path's judgement stands
    if not any(_under(actual, r) for r in real_roots(roots)):
        opened.close()
        raise Forbidden(
            f"input path {raw!r} led outside the input roots as it was opened",
            code="path_outside_roots",
        )
    return opened
