"""Stream sessions: open, chunks in order, finish or abort; idle ones reaped.

A session is judged when it opens (the output path or URL, the caller's rights,
the audio) and its directory made and its name claimed then, so nothing else
can write that file meanwhile. Its first chunk waits for CPU (and GPU) admission
like an encode and starts ffmpeg; the session holds those slots until its file
is complete (an object URL's upload then runs without them). Each chunk is
answered once it has been read: the producer may reuse the buffer at once. One
request of a session runs at a time.

Ends: ``finish`` (the file or object appears, whole), ``abort`` (``DELETE``,
nothing remains), idle for ``FRAMEWIRE_STREAM_IDLE_S`` (aborted; a first chunk
that has waited that long for admission counts as idle: nothing of it was read),
a failed chunk (the session fails with that code), an object's part the store
will not take (it fails with the store's code, at once), a client gone in the
middle of a chunk (aborted), or the worker stopping (aborted once the drain's
grace is over).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

from framewire.core.errors import (
    BadRequest,
    FramewireError,
    NotFound,
    Overloaded,
    Unavailable,
)
from framewire.core.media.argv import profile_rate
from framewire.core.wire import OutputResult, StreamChunk, StreamOpen, StreamState, StreamStateName
from framewire.service._access.paths import keep_made, remove_made
from framewire.service._access.peers import Access
from framewire.service._access.signed import ViewSigner
from framewire.service._encode.params import check_geometry
from framewire.service._encode.resources import EncodeResources
from framewire.service._encode.results import check_for, failed, written
from framewire.service._ops.disconnect import watch_caller
from framewire.service._ops.metrics import Metrics
from framewire.service._ops.shares import Share
from framewire.service._settings import Settings
from framewire.service._sources.frames import Geometry
from framewire.service._store.handoff import MemoryTarget
from framewire.service._stream.live import EndedViews, LiveFeed, ViewerSlots, check_live_profile
from framewire.service._stream.misfit import refuse_misfit
from framewire.service._stream.session import Session, ended_by, not_open
from framewire.service._stream.start import start

log = logging.getLogger("framewire.streams")

CLOSED_KEPT = 4096  # ended sessions remembered, to answer 409 stream_closed rather than 404


class Sessions:
    """Every open session of the worker, and the reaper of idle ones."""

    def __init__(self, settings: Settings, resources: EncodeResources, metrics: Metrics):
        self.settings = settings
        self.resources = resources
        self.metrics = metrics
        self.draining = False
        self._open: dict[str, Session] = {}
        self._closed: OrderedDict[str, StreamState] = OrderedDict()
        self._ended_views = EndedViews()
        self._owners: dict[str, int | None] = {}  # of the open and the remembered sessions
        self._reaper: asyncio.Task[None] | None = None
        self._failing: set[asyncio.Future[None]] = set()  # sessions whose store failed
        self.signer = ViewSigner()
        self.viewer_slots = ViewerSlots(settings.max_viewers)  # of open and ended sessions
        self._share = Share(
            settings.per_user(settings.max_streams), "FRAMEWIRE_MAX_STREAMS", "stream sessions"
        )

    # --- open ---------------------------------------------------------------------------------

    async def open(self, spec: StreamOpen, access: Access) -> Session:
        if self.draining or self.resources.stopping:
            raise Unavailable("the worker is shutting down", code="shutting_down")
        limit = self.settings.max_streams
        if len(self._open) >= limit:
            raise Overloaded(
                f"{len(self._open)} stream sessions are open (FRAMEWIRE_MAX_STREAMS={limit})",
                code="too_many_streams",
                retry_after=self.settings.stream_idle_s,
            )
        self._check_share(access)
        stack = contextlib.AsyncExitStack()
        made: list[Path] = []
        try:
            prepare = self.resources.prepare
            path, params, url = await prepare.judge_options(spec, access, stack)
            check_geometry(params, spec.width, spec.height, spec.dtype)
            if isinstance(url, MemoryTarget):
                # Named in the answer: its take waits for the file, not for the finish.
                handoffs = self.resources.uploads.handoffs
                ticket = handoffs.reserve(url)
                stack.callback(handoffs.cancel, ticket)  # unless it was held by then
                url = replace(url, ticket=ticket)
            if spec.live:
                check_live_profile(params.profile)
            directory = await prepare.place_at(path, made, access, stack, url)
        except BaseException:
            await stack.aclose()
            remove_made(made)
            raise
        geometry = Geometry(spec.dtype, spec.layout, 0, spec.height, spec.width)
        sid = secrets.token_hex(8)
        session = Session(sid, spec, path, params, geometry, directory, made, stack, url)
        self._owners[session.id] = access.owner("a stream session")
        if spec.live:
            rate, s = profile_rate(params.profile, params.fps), self.settings
            session.live = LiveFeed(
                session.id,
                self.metrics,
                self.viewer_slots,
                s.live_grace_s,
                rate,
                s.live_history_bytes,
            )
        self._open[session.id] = session
        self.metrics.streams_open.set(len(self._open))
        log.info("stream opened for %s", session.shown, extra={"stream_id": session.id})
        self._start_reaper()
        return session

    def _check_share(self, access: Access) -> None:
        """One caller may hold its share of ``FRAMEWIRE_MAX_STREAMS``, not all of them."""
        user = access.share_key
        mine = sum(self._owners.get(sid) == user for sid in self._open)
        self._share.check(user, 1, self.settings.stream_idle_s, held=mine)

    def check_owner(self, session_id: str, access: Access) -> None:
        """A session is its opener's (or an admin's): to anyone else it does not exist."""
        if session_id in self._owners and not access.owns(self._owners[session_id]):
            raise NotFound(f"no stream session {session_id!r}", code="stream_not_found")

    def get(self, session_id: str) -> Session:
        session = self._open.get(session_id)
        if session is not None:
            return session
        if session_id in self._closed:
            raise not_open(session_id, self._closed[session_id].state)
        raise NotFound(f"no stream session {session_id!r}", code="stream_not_found")

    def live_feed(self, session_id: str) -> LiveFeed | None:
        """A session's live view, open or ended within its grace (HLS serves an ended
        one's final playlist), None if it has none; else as :meth:`get`."""
        return self._ended_views.get(session_id) or self.get(session_id).live

    def state(self, session_id: str) -> StreamState:
        if session_id in self._closed:
            return self._closed[session_id]
        return self._state_of(self.get(session_id))

    def _state_of(self, session: Session) -> StreamState:
        error = session.error
        return StreamState(
            id=session.id,
            path=session.shown,
            state=session.state,
            frames_received=session.received,
            frames=session.spec.frames,
            idle_timeout_s=self.settings.stream_idle_s,
            idle_s=round(session.idle_s(), 3),
            error=None if error is None else failed(session.shown, error).error,
        )

    # --- chunks -------------------------------------------------------------------------------

    async def chunk(
        self,
        session_id: str,
        chunk: StreamChunk,
        access: Access,
        is_disconnected: Callable[[], Awaitable[bool]],
    ) -> int:
        """Read one chunk into the session's ffmpeg; returns the frames received so far."""
        session = self.get(session_id)
        async with session.lock:
            if session.state not in ("open", "streaming"):
                raise not_open(session.id, session.state)
            session.touch()
            refuse_misfit(session.received, session.geometry, session.spec, chunk)
            admission = None
            if session.output is None:  # a full queue is a 429 to retry, not an end
                admission = self.resources.scheduler.admit(1, user=access.share_key)
            # Watched from the start: a producer gone while the chunk waits for
            # admission ends the wait too.
            gone = functools.partial(session.stop, "client")  # the session is aborted
            watcher = asyncio.create_task(watch_caller(is_disconnected, session.cancel, gone))
            try:
                async with contextlib.AsyncExitStack() as held:
                    source = await self.resources.prepare.open_source(chunk.source, access, held)
                    if session.output is None:
                        assert admission is not None
                        ahead = self.settings.stream_ahead_mib << 20 if session.spec.ahead else 0
                        await start(
                            session,
                            source,
                            admission,
                            self.resources,
                            self.metrics,
                            self._store_failed,
                            ahead,
                        )
                    assert session.output is not None
                    if session.live is not None:
                        session.live.handed(session.received + source.geometry.frames)
                    uncopied = await self.resources.in_pool(
                        session.cancel, session.output.feed, source, session.check
                    )
            except BaseException as exc:  # cancellation too: the session ends, then it is raised
                # The chunk was read in part, or not at all: the file cannot be completed.
                await self._end_by(session, exc)
                raise
            finally:
                watcher.cancel()
                if admission is not None:
                    admission.close()
            frames = source.geometry.frames
            session.received += frames
            session.state = "streaming"
            session.touch()
            self.metrics.stream_chunks.inc()
            if chunk.copied_from_gpu:
                self.metrics.cuda_host_copies.inc()
            self.metrics.stream_bytes.inc(source.geometry.nbytes)
            if uncopied:
                self.metrics.stream_uncopied_bytes.inc(source.geometry.nbytes)
            return session.received

    # --- the end ------------------------------------------------------------------------------

    async def finish(self, session_id: str) -> tuple[int, OutputResult]:
        """End of frames: (HTTP status, the output's result)."""
        session = self.get(session_id)
        async with session.lock:
            if session.state not in ("open", "streaming"):
                raise not_open(session.id, session.state)
            session.touch()
            expected = session.spec.frames
            problem: FramewireError | None = None
            if session.output is None:
                problem = BadRequest("the stream received no frames", code="empty_stream")
            elif expected is not None and session.received != expected:
                problem = BadRequest(
                    f"the stream was opened for {expected} frames and received {session.received}",
                    code="frame_count_mismatch",
                )
            if problem is not None:
                await self._end(session, "failed", "error", problem)
                return problem.status, failed(session.shown, problem)
            assert session.output is not None
            session.state = "finishing"
            fps, validate = session.params.fps, session.spec.validate_
            check = check_for(session.received, session.geometry, session.params, validate)
            try:
                encoded = await self.resources.in_pool(
                    session.cancel, session.output.finish, session.check, check
                )
                result = written(encoded, fps, check, session.started, self.metrics)
                if session.url is not None:
                    await session.admission.aclose()  # the upload needs no CPU slots
                    result = await self.resources.uploads.deliver(
                        result,
                        session.directory,
                        session.path.name,
                        session.url,
                        session.spec.presign_s,
                        session.cancel,
                        session.early,
                    )
            except FramewireError as exc:
                await self._end_by(session, exc)
                return exc.status, failed(session.shown, exc)
            except BaseException as exc:  # cancelled, or a fault of no known kind (a 500)
                await self._end_by(session, exc)
                raise
            await self._end(session, "done", None, None)
            self.metrics.outputs.labels("ok").inc()
            return 200, result

    async def abort(self, session_id: str, cause: str = "deleted") -> None:
        """Stop the session; nothing of its output remains."""
        session = self.get(session_id)
        session.stop(cause)  # a chunk in progress stops at its next step, or stops waiting
        async with session.lock:
            if session.state in ("open", "streaming", "finishing"):
                await self._end(session, "aborted", cause, None)

    def _store_failed(self, session: Session, exc: FramewireError) -> None:
        """The session's object can no longer be stored: it fails now, with the store's
        code (on the loop; a request in progress ends it first, by the same error)."""

        async def fail() -> None:
            async with session.lock:
                if session.state in ("open", "streaming"):
                    await self._end(session, "failed", "error", exc)

        task = asyncio.ensure_future(fail())
        self._failing.add(task)
        task.add_done_callback(self._failing.discard)

    async def _end_by(self, session: Session, exc: BaseException) -> None:
        """A request of the session failed, or was stopped by an abort."""
        if session.aborted_by is not None:
            await self._end(session, "aborted", session.aborted_by, None)
        else:
            await self._end(session, "failed", *ended_by(exc))

    async def _end(
        self,
        session: Session,
        state: StreamStateName,
        cause: str | None,
        error: FramewireError | None,
    ) -> None:
        if cause is not None:
            self.metrics.stream_aborts.labels(cause).inc()
        if session.output is not None and state != "done":
            await asyncio.to_thread(session.output.abort)
        if session.early is not None:  # nothing of an upload not completed remains
            await asyncio.to_thread(session.early.close)
        await session.admission.aclose()  # the slots
        if session.live is not None:  # ffmpeg is gone: what it wrote goes out, then the end
            await session.live.close("finished" if state == "done" else state)
            self._ended_views.keep(session.id, session.live)
        await session.stack.aclose()  # claim, directory, audio
        (keep_made if state == "done" else remove_made)(session.made)
        # Only now: whoever reads a final state finds nothing of an unfinished output left.
        session.state, session.error = state, error
        self._open.pop(session.id, None)
        self._closed[session.id] = self._state_of(session)
        while len(self._closed) > CLOSED_KEPT:
            forgotten, _ = self._closed.popitem(last=False)
            self._owners.pop(forgotten, None)
        self.metrics.streams_open.set(len(self._open))
        fields: dict[str, object] = {"stream_id": session.id, "frames": session.received}
        if error is not None:
            fields["code"] = error.code
        ended = f" ({cause})" if cause else ""
        log.info("stream %s for %s%s", state, session.shown, ended, extra=fields)

    # --- idle sessions, shutdown ---------------------------------------------------------------

    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.create_task(self._reap())

    async def _reap(self) -> None:
        idle = self.settings.stream_idle_s
        while self._open:
            await asyncio.sleep(min(1.0, idle / 4))
            for session in list(self._open.values()):
                if session.stale(idle):
                    log.warning(
                        "stream idle for %.0f s (FRAMEWIRE_STREAM_IDLE_S): aborted",
                        session.idle_s(),
                        extra={"stream_id": session.id},
                    )
                    with contextlib.suppress(FramewireError):
                        await self.abort(session.id, cause="idle")

    async def drain(self, grace: float) -> None:
        """A shutdown began: no new sessions; open ones get ``grace`` seconds to finish."""
        self.draining = True
        deadline = time.monotonic() + grace
        while self._open and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """Abort every session still open (the grace period is over)."""
        self.draining = True
        for session_id in list(self._open):
            with contextlib.suppress(FramewireError):
                await self.abort(session_id, cause="shutdown")
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
