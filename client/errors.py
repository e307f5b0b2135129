"""One small exception hierarchy shared by the worker and its clients.

Every error carries a stable machine-readable ``code`` (what scripts match on)
and, for media failures, the tail of ffmpeg's stderr. The HTTP layer maps each
class to one status code, so the class a client sees is the class the worker
raised.
"""

from __future__ import annotations

import errno


class FramewireError(Exception):
    """Base class. ``code`` is stable; ``message`` is for people."""

    status: int = 500
    default_code: str = "internal"

    def __init__(self, message: str, *, code: str | None = None, detail: str | None = None):
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.detail = detail  # e.g. ffmpeg's stderr tail

    def __str__(self) -> str:
        text = f"[{self.code}] {self.message}"
        if self.detail:
            text += f"\n--- ffmpeg stderr (tail) ---\n{self.detail}"
        return text


class Unavailable(FramewireError):
    """The worker (or ffmpeg) cannot be reached or run."""

    status = 503
    default_code = "unavailable"


class InsufficientStorage(Unavailable):
    """The output's filesystem is full, over quota, or past a file-size limit.

    A kind of Unavailable: the request was fine, the host cannot take it now.
    """

    status = 507
    default_code = "no_space"


class BadRequest(FramewireError):
    """The request is malformed or describes data that does not match."""

    status = 400
    default_code = "bad_request"


class Conflict(BadRequest):
    """The request clashes with the state of something in use (a busy output, a stream)."""

    status = 409
    default_code = "conflict"


class Forbidden(FramewireError):
    """The request names something outside what the worker may touch."""

    status = 403
    default_code = "forbidden"


class NotFound(FramewireError):
    status = 404
    default_code = "not_found"


class MediaError(FramewireError):
    """ffmpeg failed, or a file is not the media it should be."""

    status = 422
    default_code = "media_error"


class Stalled(MediaError):
    """ffmpeg made no progress for the stall timeout and was stopped."""

    status = 504
    default_code = "ffmpeg_stalled"


class Overloaded(FramewireError):
    """The wait queue is full; retry after ``retry_after`` seconds."""

    status = 429
    default_code = "overloaded"

    def __init__(self, message: str, *, code: str | None = None, retry_after: float = 1.0):
        super().__init__(message, code=code)
        self.retry_after = retry_after


class Cancelled(FramewireError):
    """The caller went away; the work was stopped and cleaned up."""

    status = 499
    default_code = "cancelled"


# The whole hierarchy: what a status, a class name or a code can be turned back into.
HIERARCHY: tuple[type[FramewireError], ...] = (
    FramewireError,
    Unavailable,
    InsufficientStorage,
    BadRequest,
    Conflict,
    Forbidden,
    NotFound,
    MediaError,
    Stalled,
    Overloaded,
    Cancelled,
)
ERROR_CLASSES: dict[int, type[FramewireError]] = {cls.status: cls for cls in HIERARCHY}


def host_error(exc: OSError, what: str) -> FramewireError | None:
    """What an OSError stands for when the host, not the request, is at fault; else None.

    No file descriptor left is a 503 (``fd_exhausted``: retry later, raise the limit),
    a full or over-quota filesystem a 507: never a 4xx that blames the caller.
    """
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return Unavailable(
            f"{what}: the worker has no file descriptor left ({exc.strerror}); "
            "retry later, or raise its open-files limit",
            code="fd_exhausted",
        )
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return InsufficientStorage(f"{what}: {exc.strerror}")
    return None
