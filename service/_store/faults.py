"""What a failed call to the object store means for the caller: a stable code.

botocore has already retried what is worth retrying (its ``standard`` mode:
exponential backoff with full jitter, on 5xx, throttling and broken
connections, ``FRAMEWIRE_STORE_ATTEMPTS`` attempts in all), so what reaches
here is final. Messages name the operation and the store's error code only:
never the store's own message, the endpoint or anything from the credentials.
"""

from __future__ import annotations

from typing import Any

from framewire.core.errors import Conflict, FramewireError, Stalled, StoreError, Unavailable

_DENIED = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
}
_BUSY = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeTooSkewed"}
_DIGEST = {"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch"}
# A conditional write that found another object than the one judged (``owners``).
_CHANGED = {"PreconditionFailed", "ConditionalRequestConflict"}


def missing(exc: Exception) -> bool:
    """Whether ``exc`` says there is no such object (a HEAD's bare 404)."""
    from botocore import exceptions as bx

    if not isinstance(exc, bx.ClientError):
        return False
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status == 404 and exc.response.get("Error", {}).get("Code") != "NoSuchBucket"


def store_error(exc: Exception, op: str, *, late: bool = False) -> FramewireError:
    """The error a failed ``op`` (after its retries) is answered with; ``late``: its last
    attempt was cut at its deadline (``deadline``), whatever the connection then raised."""
    from botocore import exceptions as bx

    if isinstance(exc, FramewireError):
        return exc
    if late or isinstance(exc, bx.ReadTimeoutError | bx.ConnectTimeoutError):
        return Stalled(f"the object store did not answer {op} in time", code="store_timeout")
    if isinstance(exc, bx.NoCredentialsError | bx.PartialCredentialsError):
        return StoreError(
            f"{op}: the worker has no usable credentials for the object store",
            code="store_denied",
        )
    if isinstance(exc, bx.ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", "unknown"))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        said = f"the object store answered {op} with {code} ({status})"
        if code in _DENIED or status in (401, 403):
            return StoreError(f"{said}: it refused the worker's credentials", code="store_denied")
        if code == "NoSuchBucket":
            return StoreError(f"{said}: the bucket does not exist", code="store_no_bucket")
        if code in _CHANGED or status == 412:
            return Conflict(
                f"{said}: another writer replaced the object since it was judged",
                code="output_busy",
            )
        if code in _DIGEST:
            return StoreError(f"{said}: the bytes it got differ", code="store_checksum_mismatch")
        if code in _BUSY:
            return Unavailable(f"{said}, after retries", code="store_unavailable")
        if status >= 500:
            return StoreError(f"{said}, after retries", code="store_unavailable")
        return StoreError(said, code="store_refused")
    # Connection refused or reset, DNS, a broken answer: the store is not there.
    return Unavailable(
        f"the object store could not be reached for {op} ({type(exc).__name__})",
        code="store_unavailable",
    )


def changed_file() -> StoreError:
    """The spooled file's bytes are not the encode's: nothing may be stored."""
    return StoreError(
        "the spooled file is not what was encoded; nothing was stored", code="upload_failed"
    )


def answered(answer: dict[str, Any], name: str, op: str) -> str:
    """``name`` of a successful answer: a store (or something posing as one) that leaves
    it out answered nothing an upload can go on with."""
    value = answer.get(name)
    if not isinstance(value, str) or not value:
        raise StoreError(
            f"the object store answered {op} without its {name}", code="store_bad_answer"
        )
    return value
