"""POSIX shared-memory segments, opened read-only and only under the allowed prefixes."""

from __future__ import annotations

import os
import stat

from framewire.client._errors import BadRequest, Forbidden, NotFound, host_error


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
