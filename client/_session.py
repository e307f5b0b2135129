"""What a stream writer is apart from its I/O: its options, its calls, its chunk buffers
and its state; and, when no worker took the session, the local stream it writes instead.

A session belongs to the worker process that opened it: each chunk and the finish
carry that worker's ``instance``, and an answer from another one (the worker was
restarted), or no answer at all, is ``stream_lost``: the frames sent so far are gone
with the worker, so the writer fails clearly at its next call rather than hang or
write half a file.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from framewire.client._calls import Call, stream_lost
from framewire.client._local import LocalFallback, worker_gone
from framewire.client._sharing.audio import shared_audio
from framewire.client._sharing.fd import NO_ROOM, FdRegions, RegisteredMemfd
from framewire.core.errors import BadRequest, FramewireError, NotFound, Unavailable
from framewire.core.fdsocket import MISMATCH, OTHER_BYTES, take_hashed, take_output
from framewire.core.frames import Frames, describe
from framewire.core.local import LocalStream
from framewire.core.shm import Segment
from framewire.core.wire import (
    Layout,
    OutputResult,
    StreamChunk,
    StreamChunkAck,
    StreamOpen,
    StreamOpened,
    refusal,
)
from pydantic import ValidationError

ChunkBuffer = Segment | RegisteredMemfd


def _nothing(body: Any) -> None:
    return None


TAKE_TIMEOUT_S = 60.0  # taking a finished output's bytes: one request on a local socket
# The most a take before the finish's answer waits for the file, whatever the client's
# bound (a longer encode's bytes are taken after the answer instead).
FINISH_WAIT_S = 600.0
EARLY_WAIT_S = 1.0  # each early take's wait, between looks at whether the finish answered
# Ending a session: a worker that is alive ends it at once; one that is not ends it by its
# own idle bound, so a writer giving up on a silent worker does not wait out its bound again.
ABORT_TIMEOUT_S = 5.0


class WriterBase:
    """A stream's options, its chunk buffers, its calls and its state: all of a writer
    but its I/O."""

    def __init__(
        self,
        local: LocalFallback | None,
        path: str | os.PathLike[str],
        options: dict[str, Any],
        *,
        layout: Layout | str | None,
        live: bool = False,
        ahead: bool = True,
    ):
        """``options``: a save's keywords (client._base.save_options); ``ahead``: chunks
        answered once converted (wire ``StreamOpen.ahead``)."""
        # Samples are shared for the opening call alone: the worker reads them then.
        self._samples = None
        audio = options["audio"]
        if audio is not None and not isinstance(audio, (str, os.PathLike)):
            self._samples, audio = (audio, options["audio_sample_rate"]), None
        kept = {k: v for k, v in options.items() if k != "audio_sample_rate"}
        self._options: dict[str, Any] = {
            "path": os.fspath(path),
            **kept,
            "audio": None if audio is None else os.fspath(audio),
            "live": live,
            "ahead": ahead,
        }
        self._layout = layout
        self.id: str | None = None
        # The live view's watch page (signed, short-lived), once the session is open: it
        # opens at the first write (a stream written locally has none).
        self.watch_url: str | None = None
        self.hls_url: str | None = None  # the same view as an HLS playlist, signed alike
        self.result: OutputResult | None = None
        self.frames_sent = 0
        # A CUDA tensor torch would not share: its chunks go through the host from then on.
        self._through_host = False
        # Frames the worker has answered for (read into its encoder): a progress count
        # the worker reports, updated as each answer arrives (on the sender's thread).
        self.frames_received = 0
        self._buffers: list[ChunkBuffer | None] = [None, None]
        self._regions: FdRegions | None = None  # the fd handover, when the client has it
        self._turn = 0  # the buffer the next host chunk goes into
        self._error: Exception | None = None  # the first refused chunk's, raised again
        self._ended = False
        self._instance: str | None = None  # the worker process holding the session
        self._handoff: str | None = None  # a memory output's ticket, named at the opening
        self._fallback = local
        self._local: LocalStream | None = None  # in this process, when no worker took it

    def _take_early(self, answered: Callable[[], bool]) -> tuple[bytes, str] | None:
        """A ``memory://`` output's bytes and their sha256, taken under the ticket the
        session's opening named as soon as the worker holds its file (while the worker
        still hashes and checks it), to be checked once its answer comes; None when they
        could not be (the answer says why, or the take after it gets them). Asked again
        every EARLY_WAIT_S until the finish is ``answered``: a finish that fails, or never
        reaches the worker, leaves nobody waiting on a ticket its session still holds."""
        regions = self._regions  # the fd socket this client uses, and its bound
        if self._handoff is None or regions is None:
            return None
        # No longer than the finish's own answer may take: the client's bound.
        deadline = time.monotonic() + min(regions.timeout or FINISH_WAIT_S, FINISH_WAIT_S)
        while not answered() and (left := deadline - time.monotonic()) > 0:
            try:
                wait_s = min(EARLY_WAIT_S, left)
                uid = regions.worker_uid
                return take_hashed(self._handoff, regions.path, wait_s, worker_uid=uid)
            except NotFound:
                continue  # not held yet
            except (FramewireError, OSError):
                return None
        return None

    def _take_data(
        self, result: OutputResult, early: tuple[bytes, str] | None = None
    ) -> OutputResult:
        """A ``memory://`` output's bytes in ``result.data``: ``early``'s, taken before
        the answer, or taken now (over the fd socket); checked against its sha256."""
        if result.handoff is None or result.data is not None:
            return result
        if early is not None and result.handoff == self._handoff:
            data, digest = early
            if digest != result.sha256 or len(data) != result.bytes:
                raise FramewireError(OTHER_BYTES, code=MISMATCH)
            result.data = data
            return result
        path, uid = self._fd_socket()
        result.data = take_output(
            result.handoff, path, TAKE_TIMEOUT_S, worker_uid=uid, sha256=result.sha256
        )
        return result

    def _fd_socket(self) -> tuple[str | None, int | None]:
        """Where the worker's fd socket is, and whose it is (None: the defaults)."""
        regions = self._regions
        return (str(regions.path), regions.worker_uid) if regions is not None else (None, None)

    def _check_open(self) -> None:
        if self._error is not None:
            raise self._error
        if self._ended:
            raise ValueError("the writer is closed")

    def _failed(self, exc: Exception) -> None:
        if self._error is None:
            self._error = exc

    def _describe(self, frames: Any) -> Frames:
        described = describe(frames, self._layout)
        # Every chunk has the first one's layout: a short chunk's shape can look like another.
        self._layout = described.layout
        return described

    def _shared_audio(self) -> contextlib.AbstractContextManager[Any]:
        """The session's audio samples shared for the opening call (None: no samples)."""
        if self._samples is None:
            return contextlib.nullcontext(None)
        return shared_audio(*self._samples, self._regions)

    def _open_call(self, first: Frames, audio: Any = None) -> Call[StreamOpened]:
        _, _, height, width = first.dims
        fields = self._options | {
            "audio": audio or self._options["audio"],
            "dtype": first.dtype,
            "layout": first.layout,
            "height": height,
            "width": width,
        }
        try:
            body = StreamOpen.model_validate(fields).model_dump(mode="json", by_alias=True)
        except ValidationError as exc:
            raise refusal(exc) from None
        if body["ahead"]:
            del body["ahead"]  # the default: a worker older than the field takes the body
        return Call("POST", "/v1/streams", body, StreamOpened.model_validate)

    def _older_worker(self, exc: BadRequest) -> bool:
        """Whether ``exc`` is a worker older than ``"ahead"`` refusing it; if so, the
        session is opened without it (that worker answers a chunk once its pipe took it,
        which is what ``"ahead": false`` asks for)."""
        if self._options.get("ahead", True) or not exc.message.startswith("ahead: Extra"):
            return False
        self._options["ahead"] = True
        return True

    def _chunk_call(self, source: Any, frames: Frames) -> Call[StreamChunkAck]:
        assert self.id is not None
        chunk = StreamChunk(
            first_frame=self.frames_sent, source=source, copied_from_gpu=self._through_host
        )
        self.frames_sent += frames.dims[1]
        body = chunk.model_dump(mode="json", exclude_none=True)
        path = f"/v1/streams/{self.id}/frames"
        return Call("POST", path, body, StreamChunkAck.model_validate, instance=self._instance)

    def _received(self, ack: StreamChunkAck) -> StreamChunkAck:
        self.frames_received = max(self.frames_received, ack.frames_received)
        return ack

    def _finish_call(self) -> Call[OutputResult]:
        if self.id is None:
            raise ValueError("no frames were written")
        path = f"/v1/streams/{self.id}/finish"
        return Call("POST", path, None, OutputResult.model_validate, instance=self._instance)

    def _abort_call(self) -> Call[None] | None:
        """The DELETE that ends the session, if one is open on the worker."""
        if self.id is None or self.result is not None:
            return None
        # Idempotent: a session already gone answers 404, which ends it all the same.
        path = f"/v1/streams/{self.id}"
        return Call("DELETE", path, None, _nothing, idempotent=True, timeout=ABORT_TIMEOUT_S)

    def _opened(self, opened: StreamOpened) -> None:
        self.id, self._instance = opened.id, opened.instance
        self.watch_url, self.hls_url = opened.watch_url, opened.hls_url
        self._handoff = opened.handoff

    def _open_here(self, exc: Unavailable, first: Frames) -> None:
        """No worker took the session: write it in this process, or raise ``exc``."""
        if self._fallback is None or not worker_gone(exc):
            raise exc
        fields = {k: v for k, v in self._options.items() if k != "path"}
        if self._samples is not None:
            fields["audio"], fields["audio_sample_rate"] = self._samples
        self._local = self._fallback.open(exc, self._options["path"], fields, first)

    def _write_here(self, chunk: Frames) -> None:
        assert self._local is not None
        self._local.write(chunk)
        self.frames_sent += chunk.dims[1]
        self.frames_received = self.frames_sent

    @staticmethod
    def _lost(exc: Unavailable) -> FramewireError:
        """A session call that reached no worker: the session went with its worker."""
        return stream_lost(exc.message) if exc.code == "unavailable" else exc

    def _stage(self, frames: Frames, room: int = 0) -> Any:
        """Copy ``frames`` into this turn's chunk buffer (made for ``room`` bytes at least,
        the chunks to come); its descriptor."""
        segment = self._buffers[self._turn]
        if segment is None or segment.nbytes < frames.nbytes:
            if segment is not None:
                segment.close()
            segment = self._buffer_for(max(frames.nbytes, room))
            self._buffers[self._turn] = segment
        segment.write(frames)
        self._turn ^= 1
        return segment.source(frames)

    def _buffer_for(self, nbytes: int) -> ChunkBuffer:
        """A registered memfd on the fd handover; a segment without one, or when the worker
        has no room for another region."""
        if self._regions is not None:
            with contextlib.suppress(*NO_ROOM):
                return RegisteredMemfd(nbytes, self._regions)
        return Segment(nbytes)

    def _release(self) -> None:
        self._ended = True
        self._free_buffers()

    def _free_buffers(self) -> None:
        """Let go of the chunk buffers (and their regions): once every chunk is answered,
        the worker reads none of them again."""
        for i, segment in enumerate(self._buffers):
            if segment is not None:
                segment.close()
                self._buffers[i] = None
