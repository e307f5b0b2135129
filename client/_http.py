"""Client and AsyncClient: the worker's HTTP API as Python calls.

:class:`BaseClient` builds every request, reads every answer and writes each operation
once, as a plan of steps (client._plan); the twins differ only in how they take the
steps: ``httpx.Client`` and blocking work here, or ``httpx.AsyncClient`` awaited and
blocking work (copying frames, waiting on CUDA streams, connecting) in a thread. Their
public methods have the same signatures and docstrings (a test holds them to it).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, TypeVar

import httpx
from framewire.client._base import BaseClient, save_options, twin
from framewire.client._calls import Call, info_call, probe_call
from framewire.client._plan import Plan, run, run_async
from framewire.client._writers import AsyncVideoWriter, VideoWriter
from framewire.core.closing import Closing
from framewire.core.reference import ReferenceFrames, make_request
from framewire.core.wire import Layout, MediaInfo, OutputResult

T = TypeVar("T")


class Client(BaseClient[httpx.Client, VideoWriter], Closing):
    """Synchronous client. ``url`` is ``http://host:port`` or ``unix:///path/api.sock``.

    Made to live as long as the process: connections the worker closed, or that a
    restarted worker no longer answers, are replaced before use. With ``local_fallback``
    (the default) a save or stream that finds no worker is encoded here with the same
    bytes (``route == "local"``), relative paths under ``output_root``. Every socket is
    checked to be served by the worker's user (``worker_uid``, else FRAMEWIRE_WORKER_UID,
    else this process's; or root) before the token or frames go to it, and a worker on
    another host gets the token only over https or with ``trust_remote``; else
    :class:`Unavailable` ``worker_not_trusted``."""

    _writer_type = VideoWriter

    def _open_http(self) -> httpx.Client:
        return httpx.Client(transport=self._peer.transport(self._uds), **self._client_args)

    def _request(self, call: Call[Any]) -> httpx.Response:
        return self._http.request(call.method, call.path, json=call.body, timeout=call.timeouts)

    def _send(self, call: Call[T]) -> T:
        return run(self._sending(call), self._request)

    def _run(self, plan: Plan[T]) -> T:
        return run(plan, self._send)

    def info(self) -> dict[str, Any]:
        """The worker's versions, devices, limits, sockets and roots (``GET /v1/info``)."""
        return self._send(info_call())

    def probe(self, paths: Sequence[str | os.PathLike[str]]) -> list[MediaInfo]:
        """Media facts of each file (under the worker's roots), in order."""
        return self._send(probe_call(paths))

    def save_videos(
        self,
        videos: Sequence[Any],
        paths: Sequence[str | os.PathLike[str]],
        *,
        fps: float,
        quality: float | None = None,
        preset: str | None = None,
        threads: int | None = None,
        audio: Any = None,
        audio_sample_rate: int | None = None,
        profile: str = "imageio",
        value_range: tuple[float, float] | None = None,
        presign_s: int | None = None,
        validate: bool = True,
        encoder: str | None = None,
        layout: Layout | str | None = None,
    ) -> list[OutputResult]:
        """Encode each video to its path; returns one result per output, in order.

        The frames stay where they are (CUDA tensors are shared over CUDA IPC, host
        memory through shared memory); they are kept alive and must stay unmodified
        until the worker has answered. Work queued on the current CUDA stream is
        waited for first. ``encoder``: the identity the bytes must come from (docs/api.md).
        """
        options = save_options(
            fps,
            quality,
            preset,
            threads,
            audio,
            audio_sample_rate,
            profile,
            value_range,
            presign_s,
            validate,
            encoder,
        )
        return self._run(self._save_plan(videos, paths, options, layout))

    def save_video(self, video: Any, path: str | os.PathLike[str], **kw: Any) -> OutputResult:
        """:meth:`save_videos` of one video; the same keywords."""
        return self.save_videos([video], [path], **kw)[0]

    def open_video(
        self,
        path: str | os.PathLike[str],
        *,
        fps: float,
        quality: float | None = None,
        preset: str | None = None,
        threads: int | None = None,
        audio: Any = None,
        audio_sample_rate: int | None = None,
        profile: str = "imageio",
        value_range: tuple[float, float] | None = None,
        presign_s: int | None = None,
        validate: bool = True,
        encoder: str | None = None,
        layout: Layout | str | None = None,
        live: bool = False,
        ahead: bool = True,
    ) -> VideoWriter:
        """A writer for one video made chunk by chunk: ``write`` each chunk as it is
        generated, then ``close`` for the result (or ``abort``). Use it as a context
        manager: an exception inside the block aborts, and nothing of the output remains.
        The file is byte-identical to :meth:`save_video` of the concatenated frames.
        ``live=True`` asks for a live view: ``writer.watch_url`` (after the first write)
        is a page that plays the video as it is encoded, ``writer.hls_url`` the same as
        HLS for any player; the file's bytes stay the same. ``ahead=False``: a chunk is
        answered at the encoder's pace, not once converted into the worker's frames
        ahead of it, for a producer that has its own backpressure; (T, H, W, 3) uint8
        chunks then reach the encoder from the chunk buffer, never copied by the worker."""
        options = save_options(
            fps,
            quality,
            preset,
            threads,
            audio,
            audio_sample_rate,
            profile,
            value_range,
            presign_s,
            validate,
            encoder,
        )
        return self._writer(path, options, layout, live=live, ahead=ahead)

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
        decoder: str | None = None,
    ) -> ReferenceFrames:
        """The ``(T, H, W, 3)`` uint8 frames of a reference video, mapped (docs/api.md).

        Asked of the worker behind ``fd_socket``, which decodes each distinct
        request once per host and shares the pages; when it cannot be reached
        the same decode runs in this process (unless ``local_fallback=False``:
        then :class:`Unavailable`). Relative paths are taken from this process's
        working directory; ``decoder``: the ffmpeg they must come from. Close the result.
        """
        request = make_request(
            path,
            fps=fps,
            width=width,
            height=height,
            start=start,
            max_frames=max_frames,
            decoder=decoder,
        )
        return self._run(self._decode_plan(request, local_fallback))

    def close(self) -> None:
        """Close the connection pool and the fd socket (the worker drops its regions),
        and the local fallback's encoder if it ran."""
        self._handover.close()
        self._http.close()
        if self._local is not None:
            self._local.close()


class AsyncClient(BaseClient[httpx.AsyncClient, AsyncVideoWriter]):
    """The same calls as coroutines."""

    _writer_type = AsyncVideoWriter

    def _open_http(self) -> httpx.AsyncClient:
        transport = self._peer.async_transport(self._uds)
        return httpx.AsyncClient(transport=transport, **self._client_args)

    async def _request(self, call: Call[Any]) -> httpx.Response:
        return await self._http.request(
            call.method, call.path, json=call.body, timeout=call.timeouts
        )

    async def _send(self, call: Call[T]) -> T:
        return await run_async(self._sending(call), self._request)

    async def _run(self, plan: Plan[T]) -> T:
        return await run_async(plan, self._send)

    @twin(Client.info)
    async def info(self) -> dict[str, Any]:
        return await self._send(info_call())

    @twin(Client.probe)
    async def probe(self, paths: Sequence[str | os.PathLike[str]]) -> list[MediaInfo]:
        return await self._send(probe_call(paths))

    @twin(Client.save_videos)
    async def save_videos(
        self,
        videos: Sequence[Any],
        paths: Sequence[str | os.PathLike[str]],
        *,
        fps: float,
        quality: float | None = None,
        preset: str | None = None,
        threads: int | None = None,
        audio: Any = None,
        audio_sample_rate: int | None = None,
        profile: str = "imageio",
        value_range: tuple[float, float] | None = None,
        presign_s: int | None = None,
        validate: bool = True,
        encoder: str | None = None,
        layout: Layout | str | None = None,
    ) -> list[OutputResult]:
        options = save_options(
            fps,
            quality,
            preset,
            threads,
            audio,
            audio_sample_rate,
            profile,
            value_range,
            presign_s,
            validate,
            encoder,
        )
        return await self._run(self._save_plan(videos, paths, options, layout))

    @twin(Client.save_video)
    async def save_video(self, video: Any, path: str | os.PathLike[str], **kw: Any) -> OutputResult:
        return (await self.save_videos([video], [path], **kw))[0]

    @twin(Client.open_video)
    def open_video(
        self,
        path: str | os.PathLike[str],
        *,
        fps: float,
        quality: float | None = None,
        preset: str | None = None,
        threads: int | None = None,
        audio: Any = None,
        audio_sample_rate: int | None = None,
        profile: str = "imageio",
        value_range: tuple[float, float] | None = None,
        presign_s: int | None = None,
        validate: bool = True,
        encoder: str | None = None,
        layout: Layout | str | None = None,
        live: bool = False,
        ahead: bool = True,
    ) -> AsyncVideoWriter:
        options = save_options(
            fps,
            quality,
            preset,
            threads,
            audio,
            audio_sample_rate,
            profile,
            value_range,
            presign_s,
            validate,
            encoder,
        )
        return self._writer(path, options, layout, live=live, ahead=ahead)

    @twin(Client.decode_reference)
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
        decoder: str | None = None,
    ) -> ReferenceFrames:
        request = make_request(
            path,
            fps=fps,
            width=width,
            height=height,
            start=start,
            max_frames=max_frames,
            decoder=decoder,
        )
        return await self._run(self._decode_plan(request, local_fallback))

    async def aclose(self) -> None:
        """Close the connection pool and the fd socket (the worker drops its regions),
        and the local fallback's encoder if it ran."""
        self._handover.close()
        await self._http.aclose()
        if self._local is not None:
            self._local.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
