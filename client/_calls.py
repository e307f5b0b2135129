"""One HTTP call of the client: the request, and how its answer is read.

The client's twins (sync and async) and the stream writers build their calls
here and differ only in how they send them.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import httpx
from framewire.client._errors import FramewireError, Unavailable, error_class, rebuild
from framewire.client.wire import (
    EncodeRequest,
    EncodeResponse,
    MediaInfo,
    OutputResult,
    OutputSpec,
    refusal,
)
from pydantic import ValidationError

T = TypeVar("T")


class Send(Protocol):
    """How a :class:`Client` sends one call (its ``_send``)."""

    def __call__(self, call: Call[T], /) -> T: ...


class AsyncSend(Protocol):
    """How an :class:`AsyncClient` sends one call."""

    def __call__(self, call: Call[T], /) -> Awaitable[T]: ...


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


def unreachable(exc: httpx.TransportError) -> Unavailable:
    return Unavailable(f"framewire worker unreachable: {exc}")


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request, and how its answer is read."""

    method: str
    path: str
    body: dict[str, Any] | None
    read: Callable[[Any], T]

    def answer(self, response: httpx.Response) -> T:
        raise_for(response)
        return self.read(response.json())


def as_dict(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise FramewireError("the worker's answer is not a JSON object", code="protocol")
    return body


def media_list(body: Any) -> list[MediaInfo]:
    return [MediaInfo.model_validate(r) for r in as_dict(body)["results"]]


def output_list(body: Any) -> list[OutputResult]:
    return EncodeResponse.model_validate(body).outputs


def info_call() -> Call[dict[str, Any]]:
    return Call("GET", "/v1/info", None, as_dict)


def probe_call(paths: Sequence[str | os.PathLike[str]]) -> Call[list[MediaInfo]]:
    return Call("POST", "/v1/probe", {"paths": [os.fspath(p) for p in paths]}, media_list)


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
