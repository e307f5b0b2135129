"""Host frames behind a descriptor: POSIX shm segments opened by name (read-only, only
under the allowed prefixes), and descriptors a rank hands over on the fd socket."""

from __future__ import annotations

import fcntl
import mmap
import os
import stat

from framewire.core.errors import BadRequest, Forbidden, NotFound, host_error


def open_shm(key: str, prefixes: list[str]) -> int:
    """Open a POSIX shm segment read-only, if its key carries an allowed prefix."""
    if not key.startswith("/") or "/" in key[1:] or key in ("/.", "/.."):
        raise BadRequest(f"shm key {key!r} is not of the form /name", code="bad_shm_key")
    if not any(key.startswith(p) for p in prefixes):
        raise Forbidden(f"shm key {key!r} lacks an allowed prefix {prefixes}", code="shm_prefix")
    # O_NONBLOCK: a FIFO given an allowed name must not block the open (nor the loop).
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(f"/dev/shm{key}", flags)
    except FileNotFoundError as exc:
        raise NotFound(f"no shared-memory segment {key!r}", code="shm_not_found") from exc
    except OSError as exc:
        what = f"cannot open shm {key!r}"
        raise host_error(exc, what) or Forbidden(
            f"{what}: {exc.strerror}", code="shm_denied"
        ) from exc
    except ValueError as exc:  # a NUL byte, or a lone surrogate that names no file
        raise BadRequest(f"shm key {key!r} is not a file name", code="bad_shm_key") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BadRequest(f"shm key {key!r} is not a segment", code="bad_shm_key")
    return fd


def judge_fd(fd: int, offset: int, byte_size: int) -> bool:
    """Whether a rank's descriptor may be a region (raises the 4xx if not); True when it
    is sealed against shrinking, so the worker may map it.

    Only memory may be handed over: a regular file of shmem (a memfd, a file in
    /dev/shm), which ``F_GET_SEALS`` answers for and nothing else does. A file on
    disk, NFS or FUSE could make a read wait without bound; a pipe, socket or
    device is no frame store. The seals are read from the kernel, never taken
    from the request: ``F_SEAL_SHRINK`` once set cannot be removed, so a mapping
    of the first ``offset + byte_size`` bytes can never fault (SIGBUS).
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise BadRequest("the descriptor is not a regular file (memfd or /dev/shm)", code="bad_fd")
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY:
        raise BadRequest("the descriptor is open for writing only", code="bad_fd")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise BadRequest(
            "the descriptor is not memory (a memfd or a file in /dev/shm): files on disk "
            "are not taken",
            code="bad_fd",
        ) from None
    if offset + byte_size > st.st_size:
        raise BadRequest(
            f"the descriptor holds {st.st_size} bytes; the region needs "
            f"{offset + byte_size} (offset {offset} + {byte_size})",
            code="region_out_of_bounds",
        )
    sealed = bool(seals & fcntl.F_SEAL_SHRINK)
    if sealed and os.fstatvfs(fd).f_bsize != mmap.PAGESIZE:
        # hugetlbfs (MFD_HUGETLB), whose blocks are huge pages (tmpfs says PAGE_SIZE): a
        # sealed region is mapped, and huge pages map only whole and only from the
        # host's reserved pool.
        raise BadRequest(
            "the descriptor is huge-page memory (MFD_HUGETLB): hand over a memfd "
            "without MFD_HUGETLB",
            code="bad_fd",
        )
    return sealed
