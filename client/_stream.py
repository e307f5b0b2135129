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

import abc
import contextlib
import dataclasses
import logging
import os
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from framewire.client._calls import Call
from framewire.client._local import LocalFallback
from framewire.client._plan import (
    AsyncSend,
    Pending,
    Plan,
    Send,
    blocking,
    sent,
    waited,
)
from framewire.client._session import WriterBase
from framewire.client._sharing.cuda import NotShareable
from framewire.client._sharing.fd import FdRegions
from framewire.core.errors import BadRequest, Unavailable
from framewire.core.frames import Frames, is_cuda, on_host
from framewire.core.wire import Layout, OutputResult, StreamChunkAck

log = logging.getLogger("framewire.client")

T = TypeVar("T")
S = TypeVar("S", Send, AsyncSend)
Chunk = Call[StreamChunkAck]


def first_frame(chunk: Frames) -> tuple[Frames, Frames | None]:
    """A host chunk of several frames as its first frame and the rest; else it, whole."""
    _, frames, _, _ = chunk.dims
    if frames < 2 or is_cuda(chunk.video):
        return chunk, None
    head, rest = chunk.span(0, 1), chunk.span(1, frames)
    return (
        dataclasses.replace(chunk, video=head, shape=tuple(int(n) for n in head.shape)),
        dataclasses.replace(chunk, video=rest, shape=tuple(int(n) for n in rest.shape)),
    )


class StreamPlans(WriterBase, abc.ABC, Generic[S]):
    """Each of a writer's operations, as a plan (client._plan) its twin runs: the order
    of chunks and answers, the fallback to this process, and how a session ends."""

    def __init__(
        self,
        send: S,
        regions: Callable[[], Plan[FdRegions | None]],
        local: LocalFallback | None,
        path: str | os.PathLike[str],
        options: dict[str, Any],
        *,
        layout: Layout | str | None,
        live: bool = False,
        ahead: bool = True,
        release_later: Callable[[Any], None] | None = None,
    ):
        super().__init__(local, path, options, layout=layout, live=live, ahead=ahead)
        self._send: S = send  # the client's
        self._release_later = release_later  # the client's: CUDA chunks left unanswered
        self._regions_of = regions  # the client's fd handover, brought up to date
        # Host chunks on their way, oldest first; the oldest uses this turn's buffer.
        self._in_flight: deque[Pending[StreamChunkAck]] = deque()

    @abc.abstractmethod
    def _submit(self, call: Chunk) -> Pending[StreamChunkAck]:
        """Send a host chunk's ``call`` on its way, in order after those before it."""

    @abc.abstractmethod
    def _submit_call(self, call: Call[T]) -> Pending[T]:
        """Send ``call`` on its way (every chunk answered before it), to be waited for."""

    def _stop_sending(self) -> None:
        """The session is over: nothing more goes on its way."""

    def _drop_unsent(self) -> None:
        """Chunks that have not left yet stay here (the session is ending)."""

    def _let_go(self) -> None:
        """Let go of the session now, without a step (a cancellation): what has not left
        stays here, the chunk buffers are released, the worker ends the session by its
        idle bound."""
        self._drop_unsent()
        self._in_flight.clear()
        self._release()

    def _ready(self) -> bool:
        """Whether a host chunk written now would not wait on the worker: a chunk buffer
        is free (the worker answered the chunk that last used it)."""
        return len(self._in_flight) < 2 or self._in_flight[0].done()

    def _all_read(self) -> bool:
        """Whether the worker has answered every chunk written (or refused one)."""
        return all(pending.done() for pending in self._in_flight)

    def _write_plan(self, frames: Any) -> Plan[None]:
        self._check_open()
        yield from self._settle(wait=False)
        chunk = self._describe(frames)
        room = chunk.nbytes  # each buffer is made for a whole chunk
        if self.id is None and self._local is None:
            # A host chunk's first frame goes alone, the rest right after it: the encoder
            # starts on it while the rest is copied (3 MB against 25 for 8 frames at
            # 1344x768), and begins its output that much sooner.
            head, rest = first_frame(chunk)
            staged = yield from self._open_plan(head, room)
            if staged is not None and self._local is None:
                self._in_flight.append(self._submit(self._chunk_call(staged, head)))
                if rest is None:
                    return
                chunk = rest
        if self._local is not None:
            yield from blocking(self._write_here, chunk)
            return
        if is_cuda(chunk.video) and not self._through_host:
            try:
                yield from self._cuda_chunk(chunk)
                return
            except NotShareable as exc:  # nothing was sent: every chunk goes by the host
                log.warning("%s; its frames go through host memory a chunk at a time", exc)
                self._through_host = True
        if is_cuda(chunk.video):
            chunk = yield from blocking(on_host, chunk)
        if len(self._in_flight) == 2:
            yield from self._settle(wait=True, keep=1)  # the worker read the buffer's last chunk
        source = yield from blocking(self._stage, chunk, room)
        self._in_flight.append(self._submit(self._chunk_call(source, chunk)))

    def _open_plan(self, first: Frames, room: int) -> Plan[Any]:
        """Open the session; a host chunk ``first`` is copied into its buffer (made for
        ``room`` bytes) while the worker opens it (the copy and the request were each a
        few ms of the first write's wait, one after the other): its descriptor, else
        None."""
        staged = None
        try:
            self._regions = yield from self._regions_of()
            with contextlib.ExitStack() as stack:  # closed here on a failure or a cancellation
                audio = yield from blocking(stack.enter_context, self._shared_audio())
                opening = self._submit_call(self._open_call(first, audio))
                if not is_cuda(first.video):
                    try:
                        staged = yield from blocking(self._stage, first, room)
                    except Exception:
                        # Known once open, the session is ended by the abort that
                        # follows rather than left to the worker's idle bound.
                        with contextlib.suppress(Exception):
                            self._opened((yield from waited(opening)))
                        raise
                try:
                    opened = yield from waited(opening)
                except BadRequest as exc:
                    if not self._older_worker(exc):
                        raise
                    opened = yield from sent(self._open_call(first, audio))
                self._opened(opened)
                yield from blocking(stack.close)
        except Unavailable as exc:
            yield from blocking(self._open_here, exc, first)
        return staged

    def _cuda_chunk(self, chunk: Frames) -> Plan[None]:
        from framewire.client._sharing.cuda import CudaShare  # imports torch

        yield from self._settle(wait=True)  # the chunks before it go first, in order
        # Made here, on the producer's thread: its stream is the one waited for.
        share = CudaShare(chunk.video, layout=chunk.layout, release_later=self._release_later)
        ended: BaseException | None = None
        try:
            source = yield from blocking(share.__enter__)
            yield from self._chunk_plan(self._chunk_call(source, chunk))
        except BaseException as exc:
            ended = exc
            raise
        finally:
            share.end(ended)

    def _chunk_plan(self, call: Chunk) -> Plan[StreamChunkAck]:
        if self._error is not None:  # one before it was refused or lost: this one stays here
            raise self._error
        try:
            ack = yield from sent(call)
        except Unavailable as exc:
            lost = self._lost(exc)
            self._failed(lost)  # noted where it was sent: the chunk queued next sees it
            raise lost from exc
        except Exception as exc:
            self._failed(exc)
            raise
        return self._received(ack)

    def _settle(self, *, wait: bool, keep: int = 0) -> Plan[None]:
        """Collect the answers of chunks sent (all but ``keep``, or those already in);
        the first refusal is kept and raised, now and by every later call."""
        yield from self._collect(wait=wait, keep=keep)
        self._check_open()

    def _collect(self, *, wait: bool, keep: int = 0) -> Plan[None]:
        while len(self._in_flight) > keep and (wait or self._in_flight[0].done()):
            try:
                yield from waited(self._in_flight[0])
            except Exception as exc:  # the chunk's refusal; a cancellation goes on up
                self._failed(exc)
            self._in_flight.popleft()

    def _flush_plan(self, frames: int | None = None) -> Plan[None]:
        self._check_open()
        while self._in_flight and (frames is None or self.frames_received < frames):
            yield from self._collect(wait=True, keep=len(self._in_flight) - 1)
        self._check_open()

    def _close_plan(self) -> Plan[OutputResult]:
        if self.result is not None:
            return self.result
        self._check_open()
        if self._local is not None:
            self.result = yield from blocking(self._local.finish)
            return self.result
        yield from self._settle(wait=True)
        # Every chunk answered: the buffers are let go while the worker ends the file
        # (their pages' freeing, 2-3 ms a 10 MB memfd, and their regions' unregistering
        # are otherwise the caller's wait), and are gone before the output comes (a
        # memory:// output's bytes would be held beside them).
        finishing = self._submit_call(self._finish_call())
        yield from blocking(self._free_buffers)
        try:
            # A memory output's bytes, read and hashed as soon as its file is whole: beside
            # the worker's own hash and checks, not after its answer.
            early = yield from blocking(self._take_early, finishing.done)
            finished = yield from waited(finishing)
            self.result = yield from blocking(self._take_data, finished, early)
        except Unavailable as exc:
            raise self._lost(exc) from exc
        return self.result

    def _end_plan(self) -> Plan[None]:
        """End the session wherever it is; after a failed close, and by abort."""
        if self._local is not None:
            yield from blocking(self._local.abort)
            return
        # The DELETE before the chunks in flight are collected (by _shut_plan): one may wait
        # for the worker's CPU slots behind another session, and the DELETE ends that wait.
        call = self._abort_call()
        if call is not None:
            with contextlib.suppress(Exception):  # gone already: idle, failed, finished
                yield from sent(call)

    def _shut_plan(self) -> Plan[None]:
        """Collect what is still on its way, then let go of the chunk buffers."""
        try:
            self._drop_unsent()  # a chunk queued behind one the worker left unanswered
            yield from self._collect(wait=True)  # close() or abort() from a failing write
        finally:
            self._in_flight.clear()
            self._stop_sending()
            self._release()
