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
    """Base class. ``code`` is stable; ``message`` is for people; ``detail`` is ffmpeg's.

    A subclass names what sets it apart in its class line: ``status``, ``code`` (its
    default code) and ``fd_code``, each its parent's where not given.
    """

    status: ClassVar[int] = 500
    default_code: ClassVar[str] = "internal"
    fd_code: ClassVar[str] = "decode_failed"  # the fd socket names six codes only
    default_retry_after: ClassVar[float | None] = None

    def __init_subclass__(
        cls,
        *,
        status: int | None = None,
        code: str | None = None,
        fd_code: str | None = None,
        **kwargs: Any,
    ):
        super().__init_subclass__(**kwargs)
        cls.status = status or cls.status
        cls.default_code = code or cls.default_code
        cls.fd_code = fd_code or cls.fd_code

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
        # Seconds, when waiting would help.
        self.retry_after = self.default_retry_after if retry_after is None else retry_after
        # A failed encode request: every output's result (those that did succeed are
        # complete files). Any, so errors need not know the wire models.
        self.results: list[Any] | None = None

    def __str__(self) -> str:
        text = f"[{self.code}] {self.message}"
        if self.detail:
            text += f"\n--- ffmpeg stderr (tail) ---\n{self.detail}"
        return text


class Unavailable(FramewireError, status=503, code="unavailable", fd_code="unavailable"):
    """The worker (or ffmpeg) cannot be reached or run."""


class InsufficientStorage(Unavailable, status=507, code="no_space"):
    """The output's filesystem is full, over quota, or past a file-size limit.

    A kind of Unavailable: the request was fine, the host cannot take it now.
    """


class StoreError(Unavailable, status=502, code="store_unavailable"):
    """The object store refused or failed an upload (after retries): a bad gateway.

    A kind of Unavailable: the request was fine, the store behind the worker was not.
    """


class BadRequest(FramewireError, status=400, code="bad_request", fd_code="bad_request"):
    """The request is malformed or describes data that does not match."""


class Conflict(BadRequest, status=409, code="conflict"):
    """The request clashes with the state of something in use (a busy output, a stream)."""


class Forbidden(FramewireError, status=403, code="forbidden", fd_code="forbidden"):
    """The request names something outside what the worker may touch for this caller."""


class Unauthorized(Forbidden, status=401, code="unauthorized"):
    """No bearer token, or the wrong one."""


class NotFound(FramewireError, status=404, code="not_found", fd_code="not_found"):
    """Something the request names is not there: a file, a region, a stream session."""


class MediaError(FramewireError, status=422, code="media_error"):
    """ffmpeg failed, or a file is not the media it should be."""


class Stalled(MediaError, status=504, code="ffmpeg_stalled"):
    """ffmpeg made no progress for the stall timeout and was stopped."""


class Overloaded(FramewireError, status=429, code="overloaded", fd_code="overloaded"):
    """The wait queue (or a cap) is full; retry after ``retry_after`` seconds."""

    default_retry_after = 1.0


class Cancelled(FramewireError, status=499, code="cancelled"):
    """The caller went away; the work was stopped and cleaned up."""


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
