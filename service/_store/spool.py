"""Where an output bound for object storage is encoded before it is uploaded.

The spool is ``.framewire-tmp-spool`` in the first output root: the disk the
operator sized for outputs, never nameable by a request (paths may not use the
``.framewire-tmp-`` prefix), and skipped by the sweep of private directories.
An output is encoded exactly as a file is (private directory, fsync, validate,
rename) to ``<pid>-<hex><ext>`` here, uploaded, and removed whatever happened.
What a killed worker left here is removed at the next start (:func:`sweep`).

Whoever may write the output root could make that name first: a directory of
theirs would let them read every output and swap a finished file before its
upload, a link would point the sweep elsewhere. So the spool is used only as
the worker made it: a directory (never a link) owned by the worker's uid and
closed to everyone else (mode 0700), opened by fd from the root's fd and
reached only through that fd afterwards. Anything else at its name refuses
object outputs (503 ``spool_not_private``) and is left alone.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import stat
from pathlib import Path

from framewire.core.errors import Unavailable
from framewire.core.shm import pid_alive
from framewire.service._access.paths import real_roots
from framewire.service._outputs import DIR_FLAGS, TEMP_PREFIX, remove_stale_temps

SPOOL = TEMP_PREFIX + "spool"
_SPOOLED = re.compile(r"(\d+)-[0-9a-f]{16}\.[a-z0-9]+")

log = logging.getLogger("framewire.store")


def spool_dir(roots: list[str]) -> Path:
    return Path(real_roots(roots)[0]) / SPOOL


def open_spool(roots: list[str], *, make: bool = True) -> int:
    """An fd of the worker's own spool (made, mode 0700, if missing and ``make``).

    Raises ``FileNotFoundError`` if it is missing and not ``make``, 503
    ``output_root_missing`` if the root cannot be opened, 503 ``spool_not_private``
    if what is there is not a directory of the worker's closed to others."""
    root = real_roots(roots)[0]
    try:
        parent = os.open(root, DIR_FLAGS)
    except OSError as exc:
        raise Unavailable(
            f"cannot open the first output root for the upload spool ({exc.strerror})",
            code="output_root_missing",
        ) from exc
    try:
        if make:
            try:
                os.mkdir(SPOOL, 0o700, dir_fd=parent)
            except FileExistsError:
                pass
            except OSError as exc:
                raise Unavailable(
                    f"cannot make the upload spool in the first output root ({exc.strerror})",
                    code="output_root_missing",
                ) from exc
        try:
            fd = os.open(SPOOL, DIR_FLAGS | os.O_NONBLOCK, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a link, a file, a device
                raise _not_private(root, "it is not a directory") from None
            raise
    finally:
        os.close(parent)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        why = f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}"
        raise _not_private(root, why)
    return fd


def _not_private(root: str, why: str) -> Unavailable:
    return Unavailable(
        f"the upload spool {os.path.join(root, SPOOL)} is not the worker's own ({why}): "
        f"object and memory outputs are refused until it is removed",
        code="spool_not_private",
    )


def spool_path(roots: list[str], suffix: str) -> Path:
    """A fresh name in the spool (checked, made if missing) for one output."""
    os.close(open_spool(roots))
    return spool_dir(roots) / f"{os.getpid()}-{secrets.token_hex(8)}{suffix}"


def discard(directory: int, name: str) -> None:
    """Remove ``name`` from the spool open at ``directory``."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=directory)


def sweep(roots: list[str]) -> list[Path]:
    """Remove spooled files and private directories whose worker is gone; returns them.
    A spool that is not the worker's own is left as it is (and said in the log)."""
    if not roots:
        return []
    try:
        fd = open_spool(roots, make=False)
    except FileNotFoundError:
        return []
    except Unavailable as exc:
        log.warning("%s", exc.message, extra={"code": exc.code})
        return []
    shown = spool_dir(roots)
    try:
        # Through the fd, never the name again: whatever is renamed into the root meanwhile.
        here = f"/proc/self/fd/{fd}"
        removed = [shown / p.name for p in remove_stale_temps([here], depth=0)]
        for entry in os.scandir(fd):
            found = _SPOOLED.fullmatch(entry.name)
            if found is None or not entry.is_file(follow_symlinks=False):
                continue
            pid = int(found.group(1))
            if pid == os.getpid() or not pid_alive(pid):  # our pid at start: a previous worker's
                discard(fd, entry.name)
                removed.append(shown / entry.name)
        return removed
    finally:
        os.close(fd)
