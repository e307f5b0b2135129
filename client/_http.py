"""Client and AsyncClient: the worker's HTTP API as Python calls.

:class:`BaseClient` builds every request and reads every answer; the twins differ only
in how the bytes move (``httpx.Client`` or ``httpx.AsyncClient``) and where blocking work
runs (the async twin copies frames and waits on CUDA streams off the event loop). Their
public methods have the same signatures and docstrings (a test holds them to it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from typing import Any, TypeVar

import httpx
from framewire.client._base import DEFAULT_TIMEOUT, DEFAULT_URL, BaseClient, save_options, twin
from framewire.client._calls import Call, info_call, probe_call, unreachable
from framewire.client._sharing import share
from framewire.client._sharing.fd import FdRegions
from framewire.client._stream import AsyncVideoWriter, VideoWriter
from framewire.core.closing import Closing
from framewire.core.errors import Unavailable
from framewire.core.reference import ReferenceFrames, make_request
from framewire.core.wire import Layout, MediaInfo, OutputResult

T = TypeVar("T")


class Client(BaseClient, Closing):
    """Synchronous client. ``url`` is ``http://host:port`` or ``unix:///path/api.sock``.

    Made to live as long as the process: connections the worker closed, or that a
    restarted worker no longer answers, are replaced before use. With ``local_fallback``
    (the default) a save or stream that finds no worker is encoded here with the same
    bytes (``route == "local"``), relative paths under ``output_root``. Every socket is
    checked to be served by the worker's user (``worker_uid``, else FRAMEWIRE_WORKER_UID,
    else this process's; or root) before the token or frames go to it, and a worker on
    another host gets the token only over https or with ``trust_remote``; else
    :class:`Unavailable` ``worker_not_trusted``."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        fd_socket: str | os.PathLike[str] | None = None,
        token: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        local_fallback: bool = True,
        output_root: str | os.PathLike[str] | None = None,
        worker_uid: int | None = None,
        trust_remote: bool = False,
    ):
        super().__init__(url, fd_socket=fd_socket, token=token, timeout=timeout,
                         local_fallback=local_fallback, output_root=output_root,
                         worker_uid=worker_uid, trust_remote=trust_remote)  # fmt: skip
        self._http = httpx.Client(transport=self._peer.transport(self._uds), **self._client_args)

    def _send(self, call: Call[T]) -> T:
        resent = False
        while True:
            try:
                response = self._http.request(call.method, call.path, json=call.body)
            except httpx.TransportError as exc:
                if resent or not call.resendable(exc):
                    raise unreachable(exc) from exc
                resent = True  # once, on a fresh connection (the pool dropped this one)
                continue
            return self._answer(call, response)

    def _update_handover(self) -> None:
        if not self._handover.settled(self.instance):
            self._handover.connect(self.info())

    def _writer_regions(self) -> FdRegions | None:
        self._update_handover()
        return self._handover.regions

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
        self._check_pairs(videos, paths)
        options = save_options(
            fps, quality, preset, threads, audio, audio_sample_rate, profile, value_range,
            presign_s, validate, encoder,
        )  # fmt: skip
        try:
            return self._save_on_worker(videos, paths, options, layout)
        except Unavailable as exc:
            local = self._falls_back(exc)
            if local is None:
                raise
            return local.save_videos(exc, videos, paths, options, layout)

    def _save_on_worker(
        self,
        videos: Sequence[Any],
        paths: Sequence[str | os.PathLike[str]],
        options: dict[str, Any],
        layout: Layout | str | None,
    ) -> list[OutputResult]:
        self._update_handover()
        with contextlib.ExitStack() as stack:
            sources = [
                stack.enter_context(share(v, layout=layout, regions=self._handover.regions))
                for v in videos
            ]
            audios = self._share_audio(
                stack, options["audio"], options["audio_sample_rate"], len(paths)
            )
            return self._take_data(self._send(self._encode_call(sources, audios, paths, options)))

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
    ) -> VideoWriter:
        """A writer for one video made chunk by chunk: ``write`` each chunk as it is
        generated, then ``close`` for the result (or ``abort``). Use it as a context
        manager: an exception inside the block aborts, and nothing of the output remains.
        The file is byte-identical to :meth:`save_video` of the concatenated frames.
        ``live=True`` asks for a live view: ``writer.watch_url`` (after the first write)
        is a page that plays the video as it is encoded, ``writer.hls_url`` the same as
        HLS for any player; the file's bytes stay the same."""
        return VideoWriter(
            self._send,
            self._writer_regions,
            self._local,
            path,
            fps=fps,
            quality=quality,
            preset=preset,
            threads=threads,
            audio=audio,
            audio_sample_rate=audio_sample_rate,
            profile=profile,
            value_range=value_range,
            presign_s=presign_s,
            validate=validate,
            layout=layout,
            live=live,
            encoder=encoder,
        )

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
        request = make_request(path, fps=fps, width=width, height=height, start=start,
                               max_frames=max_frames, decoder=decoder)  # fmt: skip
        return self._fetch(request, local_fallback)

    def close(self) -> None:
        """Close the connection pool and the fd socket (the worker drops its regions)."""
        self._handover.close()
        self._http.close()


class AsyncClient(BaseClient):
    """The same calls as coroutines."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        fd_socket: str | os.PathLike[str] | None = None,
        token: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        local_fallback: bool = True,
        output_root: str | os.PathLike[str] | None = None,
        worker_uid: int | None = None,
        trust_remote: bool = False,
    ):
        super().__init__(url, fd_socket=fd_socket, token=token, timeout=timeout,
                         local_fallback=local_fallback, output_root=output_root,
                         worker_uid=worker_uid, trust_remote=trust_remote)  # fmt: skip
        transport = self._peer.async_transport(self._uds)
        self._http = httpx.AsyncClient(transport=transport, **self._client_args)

    async def _send(self, call: Call[T]) -> T:
        resent = False
        while True:
            try:
                response = await self._http.request(call.method, call.path, json=call.body)
            except httpx.TransportError as exc:
                if resent or not call.resendable(exc):
                    raise unreachable(exc) from exc
                resent = True
                continue
            return self._answer(call, response)

    async def _update_handover(self) -> None:
        if not await asyncio.to_thread(self._handover.settled, self.instance):
            await asyncio.to_thread(self._handover.connect, await self.info())

    async def _writer_regions(self) -> FdRegions | None:
        await self._update_handover()
        return self._handover.regions

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
        self._check_pairs(videos, paths)
        options = save_options(
            fps, quality, preset, threads, audio, audio_sample_rate, profile, value_range,
            presign_s, validate, encoder,
        )  # fmt: skip
        try:
            return await self._save_on_worker(videos, paths, options, layout)
        except Unavailable as exc:
            local = self._falls_back(exc)
            if local is None:
                raise
            return await asyncio.to_thread(local.save_videos, exc, videos, paths, options, layout)

    async def _save_on_worker(
        self,
        videos: Sequence[Any],
        paths: Sequence[str | os.PathLike[str]],
        options: dict[str, Any],
        layout: Layout | str | None,
    ) -> list[OutputResult]:
        await self._update_handover()
        with contextlib.ExitStack() as stack:
            # share() runs here, where the caller's CUDA stream is current; entering it
            # (the copy into shared memory, the stream wait) runs off the event loop.
            sources = [
                await asyncio.to_thread(
                    stack.enter_context, share(v, layout=layout, regions=self._handover.regions)
                )
                for v in videos
            ]
            audios = await asyncio.to_thread(
                self._share_audio, stack, options["audio"], options["audio_sample_rate"],
                len(paths),
            )  # fmt: skip
            results = await self._send(self._encode_call(sources, audios, paths, options))
        return await asyncio.to_thread(self._take_data, results)

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
    ) -> AsyncVideoWriter:
        return AsyncVideoWriter(
            self._send,
            self._writer_regions,
            self._local,
            path,
            fps=fps,
            quality=quality,
            preset=preset,
            threads=threads,
            audio=audio,
            audio_sample_rate=audio_sample_rate,
            profile=profile,
            value_range=value_range,
            presign_s=presign_s,
            validate=validate,
            layout=layout,
            live=live,
            encoder=encoder,
        )

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
        request = make_request(path, fps=fps, width=width, height=height, start=start,
                               max_frames=max_frames, decoder=decoder)  # fmt: skip
        return await asyncio.to_thread(self._fetch, request, local_fallback)

    async def aclose(self) -> None:
        """Close the connection pool and the fd socket (the worker drops its regions)."""
        self._handover.close()
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
