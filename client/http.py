"""Client and AsyncClient: the worker's HTTP API as Python calls."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from typing import Any

import httpx
from pydantic import ValidationError

from .errors import (
    BadRequest,
    Conflict,
    Forbidden,
    FramewireError,
    InsufficientStorage,
    MediaError,
    NotFound,
    Overloaded,
    Stalled,
    Unavailable,
)
from .reference import ReferenceFrames, decode_reference
from .share import share
from .wire import (
    EncodeRequest,
    EncodeResponse,
    Layout,
    MediaInfo,
    OutputResult,
    OutputSpec,
    error_code,
)

DEFAULT_URL = "http://127.0.0.1:7700"
DEFAULT_TIMEOUT = httpx.Timeout(3600.0, connect=10.0)
_STATUS_CLASSES: dict[int, type[FramewireError]] = {
    400: BadRequest,
    401: Forbidden,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    422: MediaError,
    429: Overloaded,
    503: Unavailable,
    504: Stalled,
    507: InsufficientStorage,
}


def _transport_args(url: str) -> tuple[str, dict[str, Any]]:
    """(base_url, extra httpx kwargs) for http(s):// and unix:///path URLs."""
    if url.startswith("unix://"):
        path = url.removeprefix("unix://")
        return "http://framewire", {"transport_uds": path}
    return url.rstrip("/"), {}


def raise_for(response: httpx.Response) -> None:
    """Turn a non-2xx answer into the exception class its status names, with the worker's code."""
    if response.is_success:
        return
    try:
        body = response.json()
    except ValueError:
        body = {}
    message = str(body.get("error") or response.text or response.reason_phrase)
    code = body.get("code")
    cls = _STATUS_CLASSES.get(response.status_code, FramewireError)
    if cls is Overloaded:
        exc: FramewireError = Overloaded(
            message, code=code, retry_after=float(response.headers.get("retry-after", 1))
        )
    else:
        detail = body.get("detail") if isinstance(body.get("detail"), str) else None
        exc = cls(message, code=code, detail=detail)
    if "outputs" in body:
        exc.results = EncodeResponse.model_validate(body).outputs  # type: ignore[attr-defined]
        failed = next((r for r in exc.results if not r.ok and r.error), None)  # type: ignore[attr-defined]
        if failed is not None and failed.error is not None:
            exc.detail = failed.error.detail
    raise exc


def _read_timeout(timeout: float | httpx.Timeout) -> float | None:
    """How long an fd-socket request may wait: the HTTP read timeout, one knob for both."""
    return timeout.read if isinstance(timeout, httpx.Timeout) else timeout


def _per_output(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} videos")
        return list(value)
    return [value] * n


def _headers(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def _encode_body(
    sources: list[Any],
    paths: Sequence[str | os.PathLike[str]],
    *,
    fps: float,
    quality: int,
    preset: str,
    threads: int | None,
    audio: Any,
    validate: bool,
) -> dict[str, Any]:
    audios = _per_output(audio, len(paths), "audio")
    try:
        outputs = [
            OutputSpec(
                source=src,
                path=os.fspath(p),
                fps=fps,
                quality=quality,
                preset=preset,  # type: ignore[arg-type]
                threads=threads,
                audio=None if a is None else os.fspath(a),
            )
            for src, p, a in zip(sources, paths, audios, strict=True)
        ]
        request = EncodeRequest(outputs=outputs, validate=validate)
    except ValidationError as exc:
        # Refused here with the code the worker would have answered.
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BadRequest(f"{where}: {first['msg']}", code=error_code(exc.errors())) from None
    return request.model_dump(mode="json", by_alias=True, exclude_none=True)


class Client:
    """Synchronous client. ``url`` is ``http://host:port`` or ``unix:///path/api.sock``."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        fd_socket: str | os.PathLike[str] | None = None,
        token: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
    ):
        base, extra = _transport_args(url)
        transport = httpx.HTTPTransport(uds=extra["transport_uds"]) if extra else None
        self.fd_socket = fd_socket  # None: FRAMEWIRE_FD_SOCKET, else the worker's default
        self.fd_timeout = _read_timeout(timeout)
        self._http = httpx.Client(
            base_url=base, transport=transport, headers=_headers(token), timeout=timeout
        )

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            response = self._http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise Unavailable(f"framewire worker unreachable: {exc}") from exc
        raise_for(response)
        return response.json()

    def info(self) -> dict[str, Any]:
        return self._call("GET", "/v1/info")

    def probe(self, paths: Sequence[str | os.PathLike[str]]) -> list[MediaInfo]:
        body = self._call("POST", "/v1/probe", json={"paths": [os.fspath(p) for p in paths]})
        return [MediaInfo.model_validate(r) for r in body["results"]]

    def save_videos(
        self,
        videos: Sequence[Any],
        paths: Sequence[str | os.PathLike[str]],
        *,
        fps: float,
        quality: int = 5,
        preset: str = "fast",
        threads: int | None = None,
        audio: Any = None,
        validate: bool = True,
        layout: Layout | str | None = None,
    ) -> list[OutputResult]:
        """Encode each video to its path; returns one result per output, in order.

        The frames stay where they are (CUDA tensors are shared over CUDA IPC, host
        memory through shared memory); they are kept alive and must stay unmodified
        until the worker has answered. Work queued on the current CUDA stream is
        waited for first.
        """
        if len(videos) != len(paths):
            raise ValueError(f"{len(videos)} videos for {len(paths)} paths")
        with contextlib.ExitStack() as stack:
            sources = [stack.enter_context(share(v, layout=layout)) for v in videos]
            body = _encode_body(
                sources,
                paths,
                fps=fps,
                quality=quality,
                preset=preset,
                threads=threads,
                audio=audio,
                validate=validate,
            )
            answer = self._call("POST", "/v1/videos:encode", json=body)
        return EncodeResponse.model_validate(answer).outputs

    def save_video(self, video: Any, path: str | os.PathLike[str], **kw: Any) -> OutputResult:
        return self.save_videos([video], [path], **kw)[0]

    def decode_reference(
        self,
        path: str | os.PathLike[str],
        *,
        fps: float,
        width: int,
        height: int,
        start: float = 0.0,
        max_frames: int | None = None,
        local_fallback: bool = True,
    ) -> ReferenceFrames:
        """The ``(T, H, W, 3)`` uint8 frames of a reference video (DESIGN §4), mapped.

        Asked of the worker behind ``fd_socket``, which decodes each distinct
        request once per host and shares the pages; when it cannot be reached
        the same decode runs in this process (unless ``local_fallback=False``:
        then :class:`Unavailable`). Relative paths are taken from this process's
        working directory. Close the result (or use it as a context manager).
        """
        return decode_reference(
            path,
            fps=fps,
            width=width,
            height=height,
            start=start,
            max_frames=max_frames,
            fd_socket=self.fd_socket,
            local_fallback=local_fallback,
            timeout=self.fd_timeout,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """The same calls as coroutines."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        fd_socket: str | os.PathLike[str] | None = None,
        token: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
    ):
        base, extra = _transport_args(url)
        transport = httpx.AsyncHTTPTransport(uds=extra["transport_uds"]) if extra else None
        self.fd_socket = fd_socket  # None: FRAMEWIRE_FD_SOCKET, else the worker's default
        self.fd_timeout = _read_timeout(timeout)
        self._http = httpx.AsyncClient(
            base_url=base, transport=transport, headers=_headers(token), timeout=timeout
        )

    async def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            response = await self._http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise Unavailable(f"framewire worker unreachable: {exc}") from exc
        raise_for(response)
        return response.json()

    async def info(self) -> dict[str, Any]:
        return await self._call("GET", "/v1/info")

    async def probe(self, paths: Sequence[str | os.PathLike[str]]) -> list[MediaInfo]:
        body = await self._call("POST", "/v1/probe", json={"paths": [os.fspath(p) for p in paths]})
        return [MediaInfo.model_validate(r) for r in body["results"]]

    async def save_videos(
        self,
        videos: Sequence[Any],
        paths: Sequence[str | os.PathLike[str]],
        *,
        fps: float,
        quality: int = 5,
        preset: str = "fast",
        threads: int | None = None,
        audio: Any = None,
        validate: bool = True,
        layout: Layout | str | None = None,
    ) -> list[OutputResult]:
        if len(videos) != len(paths):
            raise ValueError(f"{len(videos)} videos for {len(paths)} paths")
        with contextlib.ExitStack() as stack:
            # Copying frames into shm, or waiting for a CUDA stream, is blocking work: off
            # the event loop. share() itself runs here, where the caller's stream is current.
            sources = [
                await asyncio.to_thread(stack.enter_context, share(v, layout=layout))
                for v in videos
            ]
            body = _encode_body(
                sources,
                paths,
                fps=fps,
                quality=quality,
                preset=preset,
                threads=threads,
                audio=audio,
                validate=validate,
            )
            answer = await self._call("POST", "/v1/videos:encode", json=body)
        return EncodeResponse.model_validate(answer).outputs

    async def save_video(self, video: Any, path: str | os.PathLike[str], **kw: Any) -> OutputResult:
        return (await self.save_videos([video], [path], **kw))[0]

    async def decode_reference(
        self,
        path: str | os.PathLike[str],
        *,
        fps: float,
        width: int,
        height: int,
        start: float = 0.0,
        max_frames: int | None = None,
        local_fallback: bool = True,
    ) -> ReferenceFrames:
        """:meth:`Client.decode_reference`; the wait (or local decode) runs off the event loop."""
        return await asyncio.to_thread(
            decode_reference,
            path,
            fps=fps,
            width=width,
            height=height,
            start=start,
            max_frames=max_frames,
            fd_socket=self.fd_socket,
            local_fallback=local_fallback,
            timeout=self.fd_timeout,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
