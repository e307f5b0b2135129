"""One HTTP call of the client: the request, and how its answer is read.

The client's twins (sync and async) and the stream writers build their calls
here and differ only in how they send them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx
from framewire.core.errors import FramewireError, Unavailable, error_class, rebuild
from framewire.core.wire import (
    EncodeRequest,
    EncodeResponse,
    MediaInfo,
    OutputResult,
    OutputSpec,
    refusal,
)
from pydantic import ValidationError

T = TypeVar("T")


def raise_for(response: httpx.Response) -> None:
    """Turn a non-2xx answer into the exception class its status names, with the worker's code."""
    if response.is_success:
        return
    try:
        body = response.json()
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    detail = body.get("detail") if isinstance(body.get("detail"), str) else None
    retry_after = response.headers.get("retry-after")
    exc = rebuild(
        error_class(status=response.status_code),
        str(body.get("error") or response.text or response.reason_phrase),
        code=body.get("code"),
        detail=detail,
        retry_after=float(retry_after) if retry_after and retry_after.isdigit() else None,
    )
    if "outputs" in body:
        exc.results = EncodeResponse.model_validate(body).outputs
        failed = next((r for r in exc.results if not r.ok and r.error), None)
        if failed is not None and failed.error is not None:
            exc.detail = failed.error.detail
    raise exc


INSTANCE_HEADER = "framewire-instance"  # which worker process answered (every answer)

# Failures that prove the worker never had the whole request: no connection was made,
# or it went away while the request was still being written (a worker acts on a request
# only once its body is complete). Any request may be sent again after one of these.
UNSENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.WriteError)
# The worker took the request and did not answer within the bound.
_UNANSWERED = (httpx.ReadTimeout, httpx.WriteTimeout)


def unreachable(exc: httpx.TransportError) -> Unavailable:
    return Unavailable(f"framewire worker unreachable: {exc}")


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request, and how its answer is read.

    ``idempotent``: sending it twice does no more than sending it once (it only reads, or
    ends what may already have ended), so it may be sent again after any lost connection;
    other calls only when the worker cannot have received them whole (:meth:`resendable`).
    ``instance``: the worker process the request belongs to (a stream session's): an
    answer from another one is ``stream_lost``. ``timeout``: this request's own bound on
    the worker's answer, in seconds (None: the client's).
    """

    method: str
    path: str
    body: dict[str, Any] | None
    read: Callable[[Any], T]
    idempotent: bool = False
    instance: str | None = None
    timeout: float | None = None

    @property
    def timeouts(self) -> float | httpx.Timeout | Any:
        """What the transport is told: this call's bound, else the client's own."""
        return httpx.USE_CLIENT_DEFAULT if self.timeout is None else self.timeout

    def resendable(self, exc: httpx.TransportError) -> bool:
        """Whether the request may go again, once, on a fresh connection after ``exc``.

        A connection the worker closed while it idled in the pool, or one to a worker
        that has since restarted, fails this way: the worker never acted on the request.
        A request that was sent whole and then lost its answer (the worker died while it
        ran) goes again only if it is idempotent: an encode or a stream chunk may have
        been done already. One that waited out its bound is not sent again: the bound
        is the caller's whole wait."""
        if isinstance(exc, _UNANSWERED):
            return False
        return self.idempotent or isinstance(exc, UNSENT)

    def answer(self, response: httpx.Response) -> T:
        if self.instance is not None:
            answered_by = response.headers.get(INSTANCE_HEADER)
            if answered_by is not None and answered_by != self.instance:
                raise stream_lost(f"the worker was replaced (now {answered_by})")
        raise_for(response)
        return self.read(response.json())


def stream_lost(why: str) -> Unavailable:
    """A stream session whose worker went away: its frames so far are gone with it."""
    return Unavailable(
        f"the stream session is lost: {why}; nothing of its output remains", code="stream_lost"
    )


def as_dict(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise FramewireError("the worker's answer is not a JSON object", code="protocol")
    return body


def media_list(body: Any) -> list[MediaInfo]:
    return [MediaInfo.model_validate(r) for r in as_dict(body)["results"]]


def output_list(body: Any) -> list[OutputResult]:
    return EncodeResponse.model_validate(body).outputs


def info_call() -> Call[dict[str, Any]]:
    return Call("GET", "/v1/info", None, as_dict, idempotent=True)


def probe_call(paths: Sequence[str | os.PathLike[str]]) -> Call[list[MediaInfo]]:
    body = {"paths": [os.fspath(p) for p in paths]}
    return Call("POST", "/v1/probe", body, media_list, idempotent=True)  # reads only


def encode_call(
    sources: list[Any],
    audios: Sequence[Any],
    paths: Sequence[str | os.PathLike[str]],
    *,
    fps: float,
    validate: bool,
    **options: Any,
) -> Call[list[OutputResult]]:
    """``POST /v1/videos:encode`` of ``sources`` (shared already, and their ``audios``) to
    ``paths``, each with ``options`` (quality, preset, threads, profile, value_range); a
    request the worker would refuse is refused here, with the worker's code."""
    try:
        outputs = [
            OutputSpec(source=src, path=os.fspath(p), fps=fps, audio=a, **options)
            for src, p, a in zip(sources, paths, audios, strict=True)
        ]
        request = EncodeRequest(outputs=outputs, validate=validate)
    except ValidationError as exc:
        raise refusal(exc) from None  # the code the worker would have answered
    body = request.model_dump(mode="json", by_alias=True, exclude_none=True)
    return Call("POST", "/v1/videos:encode", body, output_list)


def per_output(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} videos")
        return list(value)
    return [value] * n
