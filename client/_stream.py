"""Writing one video while it is generated: the client side of a stream session.

``write(frames)`` hands over a chunk and returns as soon as it is on its way:
host frames are copied into one of two staging segments, reused in turn, and
the request for the chunk goes out on a thread (a task, for the async writer)
while the producer makes the next chunk. A staging segment is written again
only once the worker has answered the chunk that last used it (the worker
answers once it has read a chunk), so the producer's extra memory is two
chunks, whatever the length of the video. The segments are sealed memfds
registered as regions over the fd socket when the client has the fd route
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
from typing import Any, Protocol, TypeVar

from framewire.client._calls import Call
from framewire.client._sharing.fd import FdRegions, RegisteredMemfd
from framewire.client._sharing.shm import Segment
from framewire.client._sharing.video import Frames, describe, is_cuda
from framewire.client.wire import (
    Layout,
    OutputResult,
    StreamChunk,
    StreamChunkAck,
    StreamOpen,
    StreamOpened,
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


Staging = Segment | RegisteredMemfd


def _nothing(body: Any) -> None:
    return None


class _WriterBase:
    """A stream's options, its staging pair, its calls and its state: all of a writer
    but its I/O."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fps: float,
        quality: float | None,
        preset: str | None,
        threads: int | None,
        audio: Any,
        audio_sample_rate: int | None,
        profile: str,
        value_range: tuple[float, float] | None,
        validate: bool,
        layout: Layout | str | None,
        live: bool = False,
    ):
        if audio is not None and not isinstance(audio, (str, os.PathLike)):
            # Samples are judged when the session opens, before any chunk: hand them to
            # save_video, or write them to a file under the worker's input roots.
            raise ValueError("a stream's audio is a file path; audio samples go to save_video")
        del audio_sample_rate  # the same keywords as save_video: a path has its own rate
        self._options: dict[str, Any] = {
            "path": os.fspath(path),
            "fps": fps,
            "quality": quality,
            "preset": preset,
            "threads": threads,
            "audio": None if audio is None else os.fspath(audio),
            "profile": profile,
            "value_range": value_range,
            "validate": validate,
            "live": live,
        }
        self._layout = layout
        self.id: str | None = None
        # The live view's watch page (signed, short-lived), once the session is open: it
        # opens at the first write.
        self.watch_url: str | None = None
        self.result: OutputResult | None = None
        self.frames_sent = 0
        # Frames the worker has answered for (read into its encoder): a progress count
        # the worker reports, updated as each answer arrives (on the sender's thread).
        self.frames_received = 0
        self._staging: list[Staging | None] = [None, None]
        self._regions: FdRegions | None = None  # the fd route, when the client has it
        self._turn = 0  # the staging segment the next host chunk goes into
        self._error: BaseException | None = None  # the first refused chunk's, raised again
        self._ended = False

    def _check_open(self) -> None:
        if self._error is not None:
            raise self._error
        if self._ended:
            raise ValueError("the writer is closed")

    def _failed(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc

    def _describe(self, frames: Any) -> Frames:
        described = describe(frames, self._layout)
        # Every chunk has the first one's layout: a short chunk's shape can look like another.
        self._layout = described.layout
        return described

    def _open_call(self, first: Frames) -> Call[StreamOpened]:
        _, _, height, width = first.dims
        fields = self._options | {
            "dtype": first.dtype,
            "layout": first.layout,
            "height": height,
            "width": width,
        }
        try:
            body = StreamOpen.model_validate(fields).model_dump(mode="json", by_alias=True)
        except ValidationError as exc:
            raise refusal(exc) from None
        return Call("POST", "/v1/streams", body, StreamOpened.model_validate)

    def _opened(self, answer: StreamOpened) -> None:
        self.id, self.watch_url = answer.id, answer.watch_url

    def _chunk_call(self, source: Any, frames: Frames) -> Call[StreamChunkAck]:
        assert self.id is not None
        chunk = StreamChunk(first_frame=self.frames_sent, source=source)
        self.frames_sent += frames.dims[1]
        body = chunk.model_dump(mode="json", exclude_none=True)
        return Call("POST", f"/v1/streams/{self.id}/frames", body, StreamChunkAck.model_validate)

    def _received(self, ack: StreamChunkAck) -> StreamChunkAck:
        self.frames_received = max(self.frames_received, ack.frames_received)
        return ack

    def _finish_call(self) -> Call[OutputResult]:
        if self.id is None:
            raise ValueError("no frames were written")
        return Call("POST", f"/v1/streams/{self.id}/finish", None, OutputResult.model_validate)

    def _abort_call(self) -> Call[None] | None:
        """The DELETE that ends the session, if one is open on the worker."""
        if self.id is None or self.result is not None:
            return None
        return Call("DELETE", f"/v1/streams/{self.id}", None, _nothing)

    def _stage(self, frames: Frames) -> Any:
        """Copy ``frames`` into this turn's staging segment; its descriptor."""
        segment = self._staging[self._turn]
        if segment is None or segment.nbytes < frames.nbytes:
            if segment is not None:
                segment.close()
            if self._regions is None:
                segment = Segment(frames.nbytes)
            else:
                segment = RegisteredMemfd(frames.nbytes, self._regions)
            self._staging[self._turn] = segment
        segment.write(frames)
        self._turn ^= 1
        return segment.source(frames)

    def _release(self) -> None:
        self._ended = True
        for i, segment in enumerate(self._staging):
            if segment is not None:
                segment.close()
                self._staging[i] = None


class VideoWriter(_WriterBase):
    """A stream session of :class:`Client`: ``write`` chunks, then ``close`` (or ``abort``)."""

    def __init__(
        self,
        send: Send,
        route: Callable[[], FdRegions | None],
        path: str | os.PathLike[str],
        **options: Any,
    ):
        super().__init__(path, **options)
        self._send = send
        self._route = route
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="framewire-stream")
        # Host chunks on their way, oldest first; the oldest uses this turn's segment.
        self._in_flight: deque[Future[StreamChunkAck]] = deque()

    def write(self, frames: Any) -> None:
        """Hand over the next chunk of frames, in any form ``save_video`` takes."""
        self._check_open()
        self._settle(wait=False)
        chunk = self._describe(frames)
        if self.id is None:
            self._regions = self._route()
            self._opened(self._send(self._open_call(chunk)))
        if is_cuda(chunk.video):
            from framewire.client._sharing.cuda import CudaShare  # imports torch

            self._settle(wait=True)  # the chunks before it go first, in order
            with CudaShare(chunk.video, layout=chunk.layout) as source:
                self._received(self._send(self._chunk_call(source, chunk)))
            return
        if len(self._in_flight) == 2:
            self._settle(wait=True, keep=1)  # the worker has read the segment's last chunk
        source = self._stage(chunk)
        call = self._chunk_call(source, chunk)
        self._in_flight.append(self._sender.submit(self._send_chunk, call))

    def _send_chunk(self, call: Call[StreamChunkAck]) -> StreamChunkAck:
        return self._received(self._send(call))

    def close(self) -> OutputResult:
        """End of frames: returns the result once the file is complete (also ``result``)."""
        if self.result is not None:
            return self.result
        try:
            self._check_open()
            self._settle(wait=True)
            self.result = self._send(self._finish_call())
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
        while len(self._in_flight) > keep and (wait or self._in_flight[0].done()):
            try:
                self._in_flight.popleft().result()
            except BaseException as exc:
                self._failed(exc)
        self._check_open()

    def _end_session(self) -> None:
        with contextlib.suppress(BaseException):
            self._settle(wait=True)
        call = self._abort_call()
        if call is not None:
            with contextlib.suppress(Exception):  # gone already: idle, failed, finished
                self._send(call)

    def _shut(self) -> None:
        for future in self._in_flight:  # close() or abort() from a failing write
            with contextlib.suppress(BaseException):
                future.result()
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


class AsyncVideoWriter(_WriterBase):
    """The same session for :class:`AsyncClient`: ``await write(...)``, ``async with``."""

    def __init__(
        self,
        send: AsyncSend,
        route: Callable[[], Awaitable[FdRegions | None]],
        path: str | os.PathLike[str],
        **options: Any,
    ):
        super().__init__(path, **options)
        self._send = send
        self._route = route
        self._in_flight: deque[asyncio.Task[StreamChunkAck]] = deque()
        self._order = asyncio.Lock()  # chunks leave in the order they were written

    async def write(self, frames: Any) -> None:
        """Hand over the next chunk of frames, in any form ``save_video`` takes."""
        self._check_open()
        await self._settle(wait=False)
        chunk = self._describe(frames)
        if self.id is None:
            self._regions = await self._route()
            self._opened(await self._send(self._open_call(chunk)))
        if is_cuda(chunk.video):
            from framewire.client._sharing.cuda import CudaShare  # imports torch

            await self._settle(wait=True)
            share = CudaShare(chunk.video, layout=chunk.layout)  # on the producer's stream
            source = await asyncio.to_thread(share.__enter__)
            try:
                self._received(await self._send(self._chunk_call(source, chunk)))
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
            return self._received(await self._send(call))

    async def close(self) -> OutputResult:
        """End of frames: returns the result once the file is complete (also ``result``)."""
        if self.result is not None:
            return self.result
        try:
            self._check_open()
            await self._settle(wait=True)
            self.result = await self._send(self._finish_call())
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
        while len(self._in_flight) > keep and (wait or self._in_flight[0].done()):
            try:
                await self._in_flight.popleft()
            except BaseException as exc:
                self._failed(exc)
        self._check_open()

    async def _end_session(self) -> None:
        with contextlib.suppress(BaseException):
            await self._settle(wait=True)
        call = self._abort_call()
        if call is not None:
            with contextlib.suppress(Exception):
                await self._send(call)

    async def _shut(self) -> None:
        for task in self._in_flight:
            with contextlib.suppress(BaseException):
                await task
        self._in_flight.clear()
        self._release()

    async def __aenter__(self) -> AsyncVideoWriter:
        return self

    async def __aexit__(self, kind: object, exc: object, tb: object) -> None:
        if exc is None:
            await self.close()
        else:
            await self.abort()
