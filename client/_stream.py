"""Writing one video while it is generated: the client side of a stream session.

``write(frames)`` hands over a chunk and returns as soon as it is on its way:
host frames are copied into one of two chunk buffers, reused in turn, and
the request for the chunk goes out on a thread (a task, for the async writer)
while the producer makes the next chunk. A chunk buffer is written again
only once the worker has answered the chunk that last used it (the worker
answers once it has read a chunk), so the producer's extra memory is two
chunks, whatever the length of the video. The segments are sealed memfds
registered as regions over the fd socket when the client has the fd handover
(:attr:`Client.host_route`), named shm segments otherwise. CUDA chunks go as IPC handles and
``write`` waits for their answer: the producer owns that memory again only then.

The session opens at the first ``write`` (its geometry is the first chunk's)
and ends with ``close`` (the file appears whole) or ``abort`` (nothing of it
remains); as a context manager, an exception inside the block aborts. A chunk
the worker refuses is raised by the next call, and every call after it raises
the same error: the chunks after a refused one cannot be part of the file, so
``close`` then aborts the session rather than leave it to the idle timeout.
``frames_received`` is the count of the latest answer: the worker's own word on
how far it has read, for progress displays.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from framewire.client._calls import AsyncSend, Call, Send
from framewire.client._local import LocalFallback
from framewire.client._session import WriterBase
from framewire.client._sharing.fd import FdRegions
from framewire.core.errors import Unavailable
from framewire.core.frames import is_cuda
from framewire.core.wire import OutputResult, StreamChunkAck


class VideoWriter(WriterBase):
    """A stream session of :class:`Client`: ``write`` chunks, then ``close`` (or ``abort``)."""

    def __init__(
        self,
        send: Send,
        regions: Callable[[], FdRegions | None],
        local: LocalFallback | None,
        path: str | os.PathLike[str],
        **options: Any,
    ):
        super().__init__(local, path, **options)
        self._send = send
        self._regions_of = regions
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="framewire-stream")
        # Host chunks on their way, oldest first; the oldest uses this turn's segment.
        self._in_flight: deque[Future[StreamChunkAck]] = deque()

    def write(self, frames: Any) -> None:
        """Hand over the next chunk of frames, in any form ``save_video`` takes."""
        self._check_open()
        self._settle(wait=False)
        chunk = self._describe(frames)
        if self.id is None and self._local is None:
            try:
                self._regions = self._regions_of()
                with self._shared_audio() as audio:
                    self._opened(self._send(self._open_call(chunk, audio)))
            except Unavailable as exc:
                self._open_here(exc, chunk)
        if self._local is not None:
            self._write_here(chunk)
            return
        if is_cuda(chunk.video):
            from framewire.client._sharing.cuda import CudaShare  # imports torch

            self._settle(wait=True)  # the chunks before it go first, in order
            with CudaShare(chunk.video, layout=chunk.layout) as source:
                self._send_chunk(self._chunk_call(source, chunk))
            return
        if len(self._in_flight) == 2:
            self._settle(wait=True, keep=1)  # the worker has read the segment's last chunk
        source = self._stage(chunk)
        call = self._chunk_call(source, chunk)
        self._in_flight.append(self._sender.submit(self._send_chunk, call))

    def _send_chunk(self, call: Call[StreamChunkAck]) -> StreamChunkAck:
        try:
            return self._received(self._send(call))
        except Unavailable as exc:
            raise self._lost(exc) from exc

    def close(self) -> OutputResult:
        """End of frames: returns the result once the file is complete (also ``result``)."""
        if self.result is not None:
            return self.result
        try:
            self._check_open()
            if self._local is not None:
                self.result = self._local.finish()
                return self.result
            self._settle(wait=True)
            try:
                self.result = self._take_data(self._send(self._finish_call()))
            except Unavailable as exc:
                raise self._lost(exc) from exc
            return self.result
        except BaseException:
            self._end_session()
            raise
        finally:
            self._shut()

    def abort(self) -> None:
        """Stop the session; nothing of the output remains. Safe to call at any time."""
        try:
            self._end_session()
        finally:
            self._shut()

    def _settle(self, *, wait: bool, keep: int = 0) -> None:
        """Collect the answers of chunks sent (all but ``keep``, or those already in);
        the first refusal is kept and raised, now and by every later call."""
        self._collect(wait=wait, keep=keep)
        self._check_open()

    def _collect(self, *, wait: bool, keep: int = 0) -> None:
        while len(self._in_flight) > keep and (wait or self._in_flight[0].done()):
            try:
                self._in_flight[0].result()
            except Exception as exc:  # the chunk's refusal; Ctrl-C in the wait goes on up
                self._failed(exc)
            self._in_flight.popleft()

    def _end_session(self) -> None:
        if self._local is not None:
            self._local.abort()
            return
        # The DELETE before the chunks in flight are collected (by _shut): one may wait
        # for the worker's CPU slots behind another session, and the DELETE ends that wait.
        call = self._abort_call()
        if call is not None:
            with contextlib.suppress(Exception):  # gone already: idle, failed, finished
                self._send(call)

    def _shut(self) -> None:
        try:
            self._collect(wait=True)  # close() or abort() from a failing write
        finally:
            self._in_flight.clear()
            self._sender.shutdown(wait=True)
            self._release()

    def __enter__(self) -> VideoWriter:
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if exc is None:
            self.close()
        else:
            self.abort()


class AsyncVideoWriter(WriterBase):
    """The same session for :class:`AsyncClient`: ``await write(...)``, ``async with``."""

    def __init__(
        self,
        send: AsyncSend,
        regions: Callable[[], Awaitable[FdRegions | None]],
        local: LocalFallback | None,
        path: str | os.PathLike[str],
        **options: Any,
    ):
        super().__init__(local, path, **options)
        self._send = send
        self._regions_of = regions
        self._in_flight: deque[asyncio.Task[StreamChunkAck]] = deque()
        self._order = asyncio.Lock()  # chunks leave in the order they were written

    async def write(self, frames: Any) -> None:
        """Hand over the next chunk of frames, in any form ``save_video`` takes."""
        self._check_open()
        await self._settle(wait=False)
        chunk = self._describe(frames)
        if self.id is None and self._local is None:
            try:
                self._regions = await self._regions_of()
                shared = self._shared_audio()
                audio = await asyncio.to_thread(shared.__enter__)
                try:
                    self._opened(await self._send(self._open_call(chunk, audio)))
                finally:
                    await asyncio.to_thread(shared.__exit__, None, None, None)
            except Unavailable as exc:
                await asyncio.to_thread(self._open_here, exc, chunk)
        if self._local is not None:
            await asyncio.to_thread(self._write_here, chunk)
            return
        if is_cuda(chunk.video):
            from framewire.client._sharing.cuda import CudaShare  # imports torch

            await self._settle(wait=True)
            share = CudaShare(chunk.video, layout=chunk.layout)  # on the producer's stream
            source = await asyncio.to_thread(share.__enter__)
            try:
                await self._send_chunk(self._chunk_call(source, chunk))
            finally:
                share.release()
            return
        if len(self._in_flight) == 2:
            await self._settle(wait=True, keep=1)
        source = await asyncio.to_thread(self._stage, chunk)
        call = self._chunk_call(source, chunk)
        self._in_flight.append(asyncio.create_task(self._send_in_order(call)))

    async def _send_in_order(self, call: Call[StreamChunkAck]) -> StreamChunkAck:
        async with self._order:
            return await self._send_chunk(call)

    async def _send_chunk(self, call: Call[StreamChunkAck]) -> StreamChunkAck:
        try:
            return self._received(await self._send(call))
        except Unavailable as exc:
            raise self._lost(exc) from exc

    async def close(self) -> OutputResult:
        """End of frames: returns the result once the file is complete (also ``result``)."""
        if self.result is not None:
            return self.result
        try:
            self._check_open()
            if self._local is not None:
                self.result = await asyncio.to_thread(self._local.finish)
                return self.result
            await self._settle(wait=True)
            try:
                finished = await self._send(self._finish_call())
                self.result = await asyncio.to_thread(self._take_data, finished)
            except Unavailable as exc:
                raise self._lost(exc) from exc
            return self.result
        except BaseException:
            await self._end_session()
            raise
        finally:
            await self._shut()

    async def abort(self) -> None:
        """Stop the session; nothing of the output remains. Safe to call at any time."""
        try:
            await self._end_session()
        finally:
            await self._shut()

    async def _settle(self, *, wait: bool, keep: int = 0) -> None:
        await self._collect(wait=wait, keep=keep)
        self._check_open()

    async def _collect(self, *, wait: bool, keep: int = 0) -> None:
        while len(self._in_flight) > keep and (wait or self._in_flight[0].done()):
            try:
                await self._in_flight[0]
            except Exception as exc:  # the chunk's refusal; a cancellation goes on up
                self._failed(exc)
            self._in_flight.popleft()

    async def _end_session(self) -> None:
        if self._local is not None:
            await asyncio.to_thread(self._local.abort)
            return
        call = self._abort_call()  # first, as in VideoWriter._end_session
        if call is not None:
            with contextlib.suppress(Exception):
                await self._send(call)

    async def _shut(self) -> None:
        try:
            await self._collect(wait=True)
        finally:
            self._in_flight.clear()
            self._release()

    async def __aenter__(self) -> AsyncVideoWriter:
        return self

    async def __aexit__(self, kind: object, exc: object, tb: object) -> None:
        if exc is None:
            await self.close()
        else:
            await self.abort()
