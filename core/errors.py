"""One small exception hierarchy shared by the worker and its clients, and its one map.

Every error carries a stable machine-readable ``code`` (what scripts match on)
and, for media failures, the tail of ffmpeg's stderr (``detail``). Each class
names its HTTP status and the fd socket's coarser code for it; :func:`rebuild`
turns a status, a class name or an fd-socket code back into the class. The
HTTP client, the fd-socket client and server and the distributed helper all go
through here, so the class a caller sees is the class the worker raised.
"""

from __future__ import annotations

import errno
from typing import Any, ClassVar


class FramewireError(Exception):
    """Base class. ``code`` is stable; ``message`` is for people; ``detail`` is ffmpeg's."""

    status: ClassVar[int] = 500
    default_code: ClassVar[str] = "internal"
    fd_code: ClassVar[str] = "decode_failed"  # the fd socket names six codes only

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        detail: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.detail = detail  # e.g. ffmpeg's stderr tail
        self.retry_after = retry_after  # seconds, when waiting would help
        # A failed encode request: every output's result (those that did succeed are
        # complete files). Any, so errors need not know the wire models.
        self.results: list[Any] | None = None

    def __str__(self) -> str:
        text = f"[{self.code}] {self.message}"
        if self.detail:
            text += f"\n--- ffmpeg stderr (tail) ---\n{self.detail}"
        return text


class Unavailable(FramewireError):
    """The worker (or ffmpeg) cannot be reached or run."""

    status = 503
    default_code = "unavailable"
    fd_code = "unavailable"


class InsufficientStorage(Unavailable):
    """The output's filesystem is full, over quota, or past a file-size limit.

    A kind of Unavailable: the request was fine, the host cannot take it now.
    """

    status = 507
    default_code = "no_space"


class StoreError(Unavailable):
    """The object store refused or failed an upload (after retries): a bad gateway.

    A kind of Unavailable: the request was fine, the store behind the worker was not.
    """

    status = 502
    default_code = "store_unavailable"


class BadRequest(FramewireError):
    """The request is malformed or describes data that does not match."""

    status = 400
    default_code = "bad_request"
    fd_code = "bad_request"


class Conflict(BadRequest):
    """The request clashes with the state of something in use (a busy output, a stream)."""

    status = 409
    default_code = "conflict"


class Forbidden(FramewireError):
    """The request names something outside what the worker may touch for this caller."""

    status = 403
    default_code = "forbidden"
    fd_code = "forbidden"


class Unauthorized(Forbidden):
    """No bearer token, or the wrong one."""

    status = 401
    default_code = "unauthorized"


class NotFound(FramewireError):
    status = 404
    default_code = "not_found"
    fd_code = "not_found"


class MediaError(FramewireError):
    """ffmpeg failed, or a file is not the media it should be."""

    status = 422
    default_code = "media_error"


class Stalled(MediaError):
    """ffmpeg made no progress for the stall timeout and was stopped."""

    status = 504
    default_code = "ffmpeg_stalled"


class Overloaded(FramewireError):
    """The wait queue (or a cap) is full; retry after ``retry_after`` seconds."""

    status = 429
    default_code = "overloaded"
    fd_code = "overloaded"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        detail: str | None = None,
        retry_after: float | None = 1.0,
    ):
        super().__init__(message, code=code, detail=detail, retry_after=retry_after)


class Cancelled(FramewireError):
    """The caller went away; the work was stopped and cleaned up."""

    status = 499
    default_code = "cancelled"


# The whole hierarchy, most general first.
HIERARCHY: tuple[type[FramewireError], ...] = (
    FramewireError,
    Unavailable,
    InsufficientStorage,
    StoreError,
    BadRequest,
    Conflict,
    Forbidden,
    Unauthorized,
    NotFound,
    MediaError,
    Stalled,
    Overloaded,
    Cancelled,
)
_BY_STATUS = {cls.status: cls for cls in HIERARCHY}
_BY_NAME = {cls.__name__: cls for cls in HIERARCHY}
# An fd-socket code names the most general class that carries it.
_BY_FD_CODE = {
    code: next(cls for cls in HIERARCHY if cls.fd_code == code and cls is not FramewireError)
    for code in {cls.fd_code for cls in HIERARCHY}
    if code != FramewireError.fd_code
} | {FramewireError.fd_code: MediaError}
FD_CODES = frozenset(_BY_FD_CODE)


def error_class(
    *, status: int | None = None, name: str | None = None, fd_code: str | None = None
) -> type[FramewireError]:
    """The class an HTTP status, a class name or an fd-socket code stands for.

    Unknown ones are the base class: a newer worker's error is still an error.
    """
    if status is not None:
        return _BY_STATUS.get(status, FramewireError)
    if name is not None:
        return _BY_NAME.get(name, FramewireError)
    if fd_code is not None:
        return _BY_FD_CODE.get(fd_code, FramewireError)
    return FramewireError


def rebuild(
    cls: type[FramewireError],
    message: str,
    *,
    code: str | None = None,
    detail: str | None = None,
    retry_after: float | None = None,
) -> FramewireError:
    """An instance of ``cls`` from what crossed a boundary (every class takes the same)."""
    if retry_after is None and cls is Overloaded:
        retry_after = 1.0
    return cls(message, code=code, detail=detail, retry_after=retry_after)


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
