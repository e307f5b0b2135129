"""``open_video``'s writers: the twins over one set of plans (client._stream), each taking
the plans' steps its own way: on the caller's thread with a sending thread beside it, or
awaited on the event loop with a task per chunk."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from framewire.client._calls import Call
from framewire.client._plan import AsyncSend, Later, Plan, Send, run, run_async, sent
from framewire.client._stream import Chunk, StreamPlans
from framewire.core.wire import OutputResult, StreamChunkAck

T = TypeVar("T")


class VideoWriter(StreamPlans[Send]):
    """A stream session of :class:`Client`: ``write`` chunks, then ``close`` (or ``abort``)."""

    @functools.cached_property
    def _sender(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(1, thread_name_prefix="framewire-stream")

    def _run(self, plan: Plan[T], failed: Later = None, last: Later = None) -> T:
        return run(plan, self._send, failed=failed, last=last)

    def _send_chunk(self, call: Chunk) -> StreamChunkAck:
        return self._run(self._chunk_plan(call))

    def _submit(self, call: Chunk) -> Future[StreamChunkAck]:
        return self._sender.submit(self._send_chunk, call)

    def _submit_call(self, call: Call[T]) -> Future[T]:
        return self._sender.submit(self._run, sent(call))

    def _stop_sending(self) -> None:
        self._sender.shutdown(wait=True)

    def _drop_unsent(self) -> None:
        for pending in self._in_flight:
            pending.cancel()  # only one that has not started: a request on its way goes on

    def _let_go(self) -> None:
        super()._let_go()
        self._sender.shutdown(wait=False, cancel_futures=True)

    def write(self, frames: Any) -> None:
        """Hand over the next chunk of frames, in any form ``save_video`` takes."""
        self._run(self._write_plan(frames))

    def flush(self, frames: int | None = None) -> None:
        """Wait until the worker has read every chunk written so far (its refusal, if it
        refused one, is raised); ``frames``: only until it has read that many (a first
        chunk's first frame goes alone: ``flush(1)`` returns once the encoder began)."""
        self._run(self._flush_plan(frames))

    def close(self) -> OutputResult:
        """End of frames: returns the result once the file is complete (also ``result``)."""
        return self._run(self._close_plan(), failed=self._end_plan, last=self._shut_plan)

    def abort(self) -> None:
        """Stop the session; nothing of the output remains. Safe to call at any time."""
        self._run(self._end_plan(), last=self._shut_plan)

    def __enter__(self) -> VideoWriter:
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if exc is None:
            self.close()
        else:
            self.abort()


class AsyncVideoWriter(StreamPlans[AsyncSend]):
    """The same session for :class:`AsyncClient`: ``await write(...)``, ``async with``."""

    @functools.cached_property
    def _order(self) -> asyncio.Lock:
        return asyncio.Lock()  # chunks leave in the order they were written

    async def _run(self, plan: Plan[T], failed: Later = None, last: Later = None) -> T:
        return await run_async(plan, self._send, failed=failed, last=last)

    async def _send_chunk(self, call: Chunk) -> StreamChunkAck:
        return await self._run(self._chunk_plan(call))

    def _submit(self, call: Chunk) -> asyncio.Task[StreamChunkAck]:
        return asyncio.create_task(self._send_in_order(call))

    def _submit_call(self, call: Call[T]) -> asyncio.Task[T]:
        return asyncio.create_task(self._run(sent(call)))

    async def _send_in_order(self, call: Chunk) -> StreamChunkAck:
        async with self._order:
            return await self._send_chunk(call)

    async def write(self, frames: Any) -> None:
        """Hand over the next chunk of frames, in any form ``save_video`` takes."""
        await self._run(self._write_plan(frames))

    async def flush(self, frames: int | None = None) -> None:
        """Wait until the worker has read every chunk written so far (its refusal, if it
        refused one, is raised); ``frames``: only until it has read that many (a first
        chunk's first frame goes alone: ``flush(1)`` returns once the encoder began)."""
        await self._run(self._flush_plan(frames))

    async def close(self) -> OutputResult:
        """End of frames: returns the result once the file is complete (also ``result``)."""
        return await self._run(self._close_plan(), failed=self._end_plan, last=self._shut_plan)

    async def abort(self) -> None:
        """Stop the session; nothing of the output remains. Safe to call at any time."""
        await self._run(self._end_plan(), last=self._shut_plan)

    async def __aenter__(self) -> AsyncVideoWriter:
        return self

    async def __aexit__(self, kind: object, exc: object, tb: object) -> None:
        if exc is None:
            await self.close()
        else:
            await self.abort()
