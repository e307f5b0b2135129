"""An object output's parts sent while its file is still being written.

Most of an MP4's bytes are final once written: measured here, ffmpeg's mov muxer (every
profile's ``.mp4``, ``.m4v`` and ``.mov``, PyAV's writer too) goes back only to its
header at the trailer, to write the ``mdat`` box's size (bytes 40-43 of an ``.mp4`` or
``.m4v``, 28-31 of a ``.mov``; past 4 GiB a 64-bit size in the same first 48 bytes), and
matroska rewrites its header (its duration, seek head and cues' place, within the first
kilobyte). No profile moves the index to the front (``+faststart``), which would rewrite
everything. So part 1, which holds the header, goes last, once the file is whole; part
``n`` goes as soon as the file has grown past its end, while the encode runs. Nothing
depends on that measurement: when the upload completes, every part sent early is checked
against the finished file's bytes and sent again where they differ
(service/_store/multipart.py), and the object appears only then, only whole.

The follower polls the file's size every :data:`POLL_S` on a thread of its own; its parts
go out on the store's part pool, at most ``PARTS_IN_FLIGHT`` of this output at once, so
what it holds is that many parts whatever the file's size. A part that fails (after the
store's retries) ends the follow: the encode stops at its next check with the store's
code (a session, at once, through ``on_failure``), and the upload is aborted.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from framewire.core.errors import Cancelled, FramewireError
from framewire.service._outputs import TempOutput
from framewire.service._store.multipart import (
    PARTS_IN_FLIGHT,
    Multipart,
    Part,
    Started,
    Upload,
    stop_parts,
)

POLL_S = 0.05  # how often the file's size is looked at while it is written
log = logging.getLogger("framewire.store")


class EarlyUpload:
    """Follows one output's file while it is written (``writing``), sending its parts 2,
    3, ... to a multipart upload begun with the first of them; ``handover`` gives that
    upload to the final one (service/_store/s3.py's ``upload``), ``close`` aborts it
    unless it was handed over."""

    def __init__(
        self,
        multipart: Multipart,
        up: Upload,
        on_failure: Callable[[FramewireError], None] = lambda exc: None,
    ):
        self.multipart = multipart
        self.up = up  # the client, the object, and the output's cancel
        self.part_bytes = multipart.store.part_bytes
        self.on_failure = on_failure
        self.started: Started | None = None  # the multipart upload, once a part is ready
        self.failure: FramewireError | None = None
        self.settled = False  # handed over: completed or aborted by the final upload
        self._pending: deque[tuple[int, Future[Part]]] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dir = -1

    # --- the encode's side (a follower of its output: service/_outputs.py) ---------------

    def destination(self) -> TempOutput | None:
        """The encode writes its own file (followed from :meth:`writing`)."""
        return None

    def writing(self, temp: TempOutput) -> None:
        """The output is written at ``temp`` from now on: follow it."""
        if self._thread is not None:
            return  # the fallback route writes the same file again: already followed
        self._dir = os.dup(temp.fd)  # the encode closes its own when it ends
        self._thread = threading.Thread(
            target=self._follow, args=(temp.name,), name="framewire-early-upload", daemon=True
        )
        self._thread.start()

    def check(self) -> None:
        """Raise what stopped the upload (the encode then stops with its code)."""
        if self.failure is not None:
            raise self.failure

    def written(self, temp: TempOutput) -> None:
        """The file is whole: what is left goes at :meth:`handover`, after its digest."""

    # --- the follow, on its own thread --------------------------------------------------

    def _follow(self, name: str) -> None:
        fd = -1
        number = 2  # part 1 holds what the muxer rewrites: it goes last
        try:
            while not self._stop.wait(POLL_S):
                if fd < 0:
                    try:
                        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                        fd = os.open(name, flags, dir_fd=self._dir)
                    except FileNotFoundError:
                        continue  # the child has not opened it yet
                size = os.fstat(fd).st_size
                while size >= number * self.part_bytes and not self._stop.is_set():
                    self._collect(wait=len(self._pending) >= PARTS_IN_FLIGHT)
                    body = os.pread(fd, self.part_bytes, (number - 1) * self.part_bytes)
                    if len(body) < self.part_bytes:
                        break  # shorter again: written anew (the fallback route)
                    self._send(number, body)
                    number += 1
                self._collect(wait=False)
        except FramewireError as exc:
            self._fail(exc)
        except OSError as exc:  # the spool file unreadable: the final upload reads it again
            log.warning("stopped sending %s early: %s", self.up.url, exc)
        finally:
            if fd >= 0:
                os.close(fd)

    def _send(self, number: int, body: bytes) -> None:
        if self.started is None:
            self.started = self.multipart.begin(self.up)
        upload_id = self.started.upload_id
        sent = self.multipart.submit(self.multipart.send_part, self.up, upload_id, number, body)
        self._pending.append((number, sent))

    def _collect(self, *, wait: bool) -> None:
        """Note the parts whose answers came (waiting for the oldest if ``wait``); raises
        a part's failure."""
        while self._pending and (wait or self._pending[0][1].done()):
            number, future = self._pending.popleft()
            part = future.result()
            assert self.started is not None
            self.started.sent[number] = part
            wait = False

    def _fail(self, exc: FramewireError) -> None:
        self.failure = exc
        self._stop.set()
        if not isinstance(exc, Cancelled):  # the output's own stop: nothing to tell
            self.on_failure(exc)

    # --- the end ------------------------------------------------------------------------

    def _stopped(self) -> None:
        """The follow ended and every part it sent answered (or failed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            while self._pending:
                self._collect(wait=True)
        except FramewireError as exc:
            self.failure = self.failure or exc
        finally:
            stop_parts(future for _, future in self._pending)
            self._pending.clear()
            if self._dir >= 0:
                os.close(self._dir)
                self._dir = -1

    def handover(self) -> Started | None:
        """The file is whole: the multipart upload its early parts went to (None: none
        did), the final upload's to complete or abort from now on. Raises what stopped
        the follow."""
        self._stopped()
        self.check()
        self.settled = self.started is not None
        return self.started

    def close(self) -> None:
        """The output ended (done, failed or stopped): nothing of an upload not handed
        over remains."""
        self._stopped()
        if self.started is not None and not self.settled:
            self.settled = True
            self.multipart.store.abort(self.up, self.started.upload_id)
