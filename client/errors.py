"""One small exception hierarchy shared by the worker and its clients.

Every error carries a stable machine-readable ``code`` (what scripts match on)
and, for media failures, the tail of ffmpeg's stderr. The HTTP layer maps each
class to one status code, so the class a client sees is the class the worker
raised.
"""

from __future__ import annotations


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
    Forbidden,
    NotFound,
    MediaError,
    Overloaded,
    Cancelled,
)
ERROR_CLASSES: dict[int, type[FramewireError]] = {cls.status: cls for cls in HIERARCHY}
