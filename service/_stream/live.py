"""The live view of a stream session: the encode's fragmented MP4, fanned out to viewers.

ffmpeg's tee writes the file and, from the same packets, a fragmented MP4 into a
pipe (core/media/argv.py ``live_output``). A thread reads that pipe without
pause, so ffmpeg never waits on viewers; it cuts the bytes into the init segment
(``ftyp`` + ``moov``) and fragments (``moof`` + ``mdat``) and hands them to the
event loop, which keeps them for late joiners and queues them for each viewer.

Bounds: the history kept for late joiners and HLS (history.py) is about
``FRAMEWIRE_LIVE_HISTORY_BYTES``, cut at keyframes; past twice that with no keyframe
to cut to, it is released and new viewers are refused (``409 live_history_full``), while
those already watching go on. A viewer's queue holds at most ``VIEWER_QUEUE_BYTES``
beyond what it has taken; a viewer that falls further behind is dropped. Once
the session has ended, a viewer has ``FRAMEWIRE_LIVE_GRACE_S`` to take what is
left: past it the rest is dropped and its stream ends as ``too_slow``; the history
stays as long for HLS players (``EXT-X-ENDLIST``, then a complete playlist), then is
released. Every viewer holds one of the worker's
``FRAMEWIRE_MAX_VIEWERS`` slots until its response is over, whether its session
is still open or not (``ViewerSlots``).

Every viewer's byte stream ends with a ``free`` box naming why it ended
(``{"framewire": "end", "reason": ...}``): players skip ``free`` boxes, and the
watch page reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import InitVar, dataclass
from fractions import Fraction

from framewire.core.errors import BadRequest, Conflict, Overloaded
from framewire.core.media.pipe import F_SETPIPE_SZ
from framewire.service._ops.metrics import Metrics
from framewire.service._stream.fmp4 import boxes, end_box, starts_with_keyframe, video_samples
from framewire.service._stream.history import History
from framewire.service._stream.hls import Timing

VIEWER_QUEUE_BYTES = 8 << 20
ENDED_HISTORY_BYTES = 256 << 20
VIEWERS_PER_STREAM = 16
HLS_REQUESTS_PER_STREAM = 2 * VIEWERS_PER_STREAM  # a player has a playlist and a part out
PIPE_BYTES = 1 << 20  # the pipe ffmpeg writes the fragments into (F_SETPIPE_SZ)
READ_BYTES = 1 << 16
EOF_WAIT_S = 10.0  # ffmpeg has exited or been killed when this is awaited


def check_live_profile(profile: str) -> None:
    if profile == "vllm-omni":
        raise BadRequest(
            "the vllm-omni profile is muxed by PyAV, which has no second output for a "
            "live view: open the stream without live, or with an ffmpeg profile",
            code="live_unsupported",
        )


class Viewer:
    """One viewer's queue: the bytes it has not taken yet, bounded."""

    def __init__(self, history: list[bytes]):
        self._queue: deque[bytes] = deque(history)  # shared bytes, not copies
        self._queued = 0  # live bytes waiting (the history does not count)
        self._wake = asyncio.Event()
        self._wake.set()
        self.reason: str | None = None
        self.sent = 0

    def push(self, data: bytes) -> bool:
        """Queue ``data``; False if that takes the viewer past its bound."""
        if self.reason is not None:
            return True
        if self._queued + len(data) > VIEWER_QUEUE_BYTES:
            return False
        self._queue.append(data)
        self._queued += len(data)
        self._wake.set()
        return True

    def cut(self) -> bool:
        """Drop what the viewer has not taken, ending its stream as ``too_slow``; False
        when at most its end box was left to send."""
        if len(self._queue) <= 1:
            return False
        self.reason = None  # the session's end, not yet sent: this one replaces it
        self.end("too_slow", drop_queued=True)
        return True

    def end(self, reason: str, *, drop_queued: bool = False) -> None:
        if self.reason is not None:
            return
        if drop_queued:
            self._queue.clear()
            self._queued = 0
        self.reason = reason
        self._queue.append(end_box(reason))
        self._wake.set()

    async def stream(self) -> AsyncIterator[bytes]:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                data = self._queue.popleft()
                self._queued = max(0, self._queued - len(data))
                self.sent += len(data)
                yield data
            if self.reason is not None:
                return


class ViewerSlots:
    """The worker's cap on live viewers, all sessions together. A viewer holds its slot
    until its response is over, not until its session ends: one that reads slowly holds
    a connection and what is queued for it as long as it reads."""

    def __init__(self, limit: int):
        self.limit = limit
        self.taken = 0

    def take(self) -> None:
        if self.taken >= self.limit:
            raise Overloaded(
                f"{self.taken} live viewers are watching (FRAMEWIRE_MAX_VIEWERS={self.limit})",
                code="too_many_viewers",
                retry_after=5,
            )
        self.taken += 1

    def give(self) -> None:
        self.taken -= 1


@dataclass(eq=False)
class LiveFeed:
    """One session's live view: the pipe from ffmpeg, what it said so far, its viewers."""

    stream_id: str
    metrics: Metrics
    slots: ViewerSlots
    grace_s: float  # for viewers to take the rest once the session has ended
    rate: InitVar[Fraction]  # the encode's frame rate
    history_bytes: InitVar[int | None] = None

    def __post_init__(self, rate: Fraction, history_bytes: int | None) -> None:
        self.timing = Timing(rate)
        self._loop = asyncio.get_running_loop()
        self.viewers: set[Viewer] = set()
        self.hls_requests = 0  # being answered now
        self.history = History(history_bytes)
        self._changed = asyncio.Event()  # set, and replaced, at each change to the history
        self._init = False
        self._frames = 0  # video frames in the fragments so far
        self._handed: deque[tuple[int, float]] = deque()  # (frames received by then, when)
        self._fds: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._eof = asyncio.Event()
        self.reason: str | None = None

    # --- the encoder's side ------------------------------------------------------------------

    def open_pipe(self) -> int:
        """The write end ffmpeg gets; the worker's copy closes once ffmpeg runs."""
        read, write = os.pipe()
        with contextlib.suppress(OSError):
            fcntl.fcntl(write, F_SETPIPE_SZ, PIPE_BYTES)
        self._fds = (read, write)
        return write

    def started(self) -> None:
        """ffmpeg holds the write end (or failed to start): read until it closes it."""
        assert self._fds is not None
        read, write = self._fds
        os.close(write)
        self._fds = (read, -1)
        self._thread = threading.Thread(
            target=self._read, args=(read,), name="framewire-live", daemon=True
        )
        self._thread.start()

    def handed(self, received: int) -> None:
        """Frames up to ``received`` were handed to the encoder now (for the delay)."""
        self._handed.append((received, time.monotonic()))

    def _read(self, fd: int) -> None:
        pending = bytearray()
        try:
            while block := os.read(fd, READ_BYTES):
                pending += block
                found = boxes(pending)
                cut = 0
                for i, (kind, a, b) in enumerate(found):
                    # The init segment goes out whole at the first moof; a fragment, at its mdat.
                    if kind == b"moof" and not self._init and a > 0:
                        self._init = True
                        self._loop.call_soon_threadsafe(self._publish_init, bytes(pending[:a]))
                        cut = a
                    if kind == b"mdat" and i > 0 and found[i - 1][0] == b"moof":
                        moof = bytes(pending[found[i - 1][1] : found[i - 1][2]])
                        fragment = bytes(pending[cut:b])
                        self._loop.call_soon_threadsafe(
                            self._publish, fragment, video_samples(moof), starts_with_keyframe(moof)
                        )
                        cut = b
                del pending[:cut]
        except (OSError, RuntimeError):  # the pipe failed; the loop closed (worker stopping)
            pass
        finally:
            os.close(fd)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody watches
                self._loop.call_soon_threadsafe(self._eof.set)

    def _publish_init(self, data: bytes) -> None:
        self.history.add_init(data)
        self._send(data)

    def _publish(self, data: bytes, frames: int, key: bool) -> None:
        self._frames += frames
        while self._handed and self._handed[0][0] <= self._frames:
            _, at = self._handed.popleft()
            self.metrics.live_delay.observe(time.monotonic() - at)
        self.history.add(data, frames, key)
        self._send(data)

    def _send(self, data: bytes) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        for viewer in list(self.viewers):
            if not viewer.push(data):
                self._drop(viewer, "too_slow", drop_queued=True)

    async def wait_for(self, ready: Callable[[], bool], bound_s: float) -> str:
        """Wait until ``ready()``, the feed's end or ``bound_s``: which came first
        (``ready``, ``ended``, ``bound``)."""
        deadline = time.monotonic() + bound_s
        while not ready():
            left = deadline - time.monotonic()
            if self.ended or left <= 0:
                return "ended" if self.ended else "bound"
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._changed.wait()
        return "ready"

    @contextlib.contextmanager
    def hls_request(self) -> Iterator[None]:
        """One HLS request of this view while it is answered. It counts as a viewer does
        (a slot of ``FRAMEWIRE_MAX_VIEWERS``, a place among the view's own), for as long
        as it is answered: a blocking reload waits at most ``BLOCK_MAX_S``."""
        if self.history.released:
            raise self._released()
        if self.hls_requests >= HLS_REQUESTS_PER_STREAM:
            raise Overloaded(
                f"stream {self.stream_id} is answering {self.hls_requests} HLS requests "
                f"(at most {HLS_REQUESTS_PER_STREAM} a stream)",
                code="too_many_viewers",
                retry_after=5,
            )
        self.slots.take()
        self.hls_requests += 1
        self.metrics.hls_in_flight.inc()
        try:
            yield
        finally:
            self.hls_requests -= 1
            self.metrics.hls_in_flight.dec()
            self.slots.give()

    @property
    def ended(self) -> bool:
        return self.reason is not None

    # --- viewers -----------------------------------------------------------------------------

    def join(self) -> Viewer:
        if self.reason is not None:
            raise Conflict(f"stream {self.stream_id} has ended", code="stream_closed")
        if self.history.released:
            raise self._released()
        if len(self.viewers) >= VIEWERS_PER_STREAM:
            raise Overloaded(
                f"stream {self.stream_id} has {len(self.viewers)} viewers "
                f"(at most {VIEWERS_PER_STREAM} a stream)",
                code="too_many_viewers",
                retry_after=5,
            )
        self.slots.take()
        viewer = Viewer(self.history.replay())
        self.viewers.add(viewer)
        self.metrics.live_viewers.inc()
        return viewer

    def _released(self) -> Conflict:
        if self.ended:
            return Conflict(f"stream {self.stream_id} has ended", code="stream_closed")
        return Conflict(
            f"the live view of stream {self.stream_id} has gone over {2 * self.history.bound} "
            "bytes since a keyframe: it is no longer kept for viewers who join now",
            code="live_history_full",
        )

    def leave(self, viewer: Viewer) -> None:
        """The viewer's response is over (ended, dropped, or the viewer went away)."""
        if viewer in self.viewers:
            self.viewers.discard(viewer)
            self.slots.give()
            self.metrics.live_viewers.dec()
            if viewer.reason is None:
                self.metrics.live_drops.labels("gone").inc()
        self.metrics.live_bytes.inc(viewer.sent)
        viewer.sent = 0

    def _drop(self, viewer: Viewer, cause: str, *, drop_queued: bool = False) -> None:
        viewer.end(cause, drop_queued=drop_queued)
        self.metrics.live_drops.labels(cause).inc()

    async def close(self, reason: str) -> None:
        """The session ended (``finished``, ``aborted``, ``failed``): after what ffmpeg
        wrote has gone out, every viewer's stream ends with ``reason``."""
        if self._fds is not None and self._fds[1] >= 0:
            os.close(self._fds[1])  # ffmpeg never started: nothing was read
            os.close(self._fds[0])
        elif self._thread is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(EOF_WAIT_S):
                    await self._eof.wait()
        self._fds = None
        self.reason = reason
        self._changed.set()  # blocked HLS requests get the final playlist
        for viewer in self.viewers:
            viewer.end(reason)
        self._loop.call_later(self.grace_s, self._cut_late)

    def _cut_late(self) -> None:
        """The grace after the end is over: the history is released, and what viewers
        still have not taken is dropped, so that a slow reader holds no history, nor
        queue, of an ended session."""
        self.history.release()
        for viewer in self.viewers:
            if viewer.cut():
                self.metrics.live_drops.labels("too_slow").inc()


class EndedViews:
    """Ended sessions' live views within their grace, for HLS players to finish (the
    final playlist, its segments), their histories under ``ENDED_HISTORY_BYTES`` all
    together: past it the oldest is released early."""

    def __init__(self) -> None:
        self._feeds: OrderedDict[str, LiveFeed] = OrderedDict()

    def keep(self, session_id: str, feed: LiveFeed) -> None:
        self._feeds[session_id] = feed
        for sid, old in list(self._feeds.items()):
            if old.history.released:
                del self._feeds[sid]
        kept = sum(f.history.bytes for f in self._feeds.values())
        while kept > ENDED_HISTORY_BYTES:
            _, old = self._feeds.popitem(last=False)
            kept -= old.history.bytes
            old.history.release()

    def get(self, session_id: str) -> LiveFeed | None:
        feed = self._feeds.get(session_id)
        return None if feed is None or feed.history.released else feed
