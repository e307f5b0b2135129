"""The pipe a child reads its frames from, fed in bounded steps.

The write end is non-blocking: while the pipe is full, every send polls in short
steps, so a cancellation (``check``) gets a say even while the child reads nothing,
and its owner (core.media.process) can tell a child that stopped making progress.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
from collections.abc import Callable

from framewire.core.errors import BadRequest

POLL_S = 0.1  # how often a blocked send or a wait looks at cancellation and progress
PIPE_BYTES = 1 << 20  # fewer wakeups per chunk than the 64 KiB default
SEND_SLICE = 16 << 20  # bytes per sendfile call
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def no_check() -> None:
    pass


class FfmpegExited(Exception):
    """ffmpeg stopped reading before it had every frame (it died or failed)."""


class PipeWriter:
    """The write end of a pipe, made non-blocking and fed in bounded steps.

    While the pipe is full, ``watch(check)`` runs every ``POLL_S`` (it may raise to
    stop); ``progressed()`` runs after every write that moved bytes.
    """

    def __init__(
        self,
        fd: int,
        *,
        watch: Callable[[Callable[[], None]], None] | None = None,
        progressed: Callable[[], None] = no_check,
    ):
        self.fd = fd
        self._watch = watch or (lambda check: check())
        self._progressed = progressed
        os.set_blocking(fd, False)
        with contextlib.suppress(OSError):  # capped by /proc/sys/fs/pipe-max-size
            fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_BYTES)

    def _wait_writable(self, check: Callable[[], None]) -> None:
        poll = select.poll()
        poll.register(self.fd, select.POLLOUT)
        while not poll.poll(POLL_S * 1e3):
            self._watch(check)
        check()

    def send_file(
        self, in_fd: int, offset: int, count: int, check: Callable[[], None] = no_check
    ) -> None:
        """sendfile ``count`` bytes at ``offset`` of ``in_fd`` into the pipe.

        EPIPE means the reader is gone (:class:`FfmpegExited`); a zero return means
        the source file got shorter (``segment_truncated``).
        """
        while count > 0:
            try:
                n = os.sendfile(self.fd, in_fd, offset, min(count, SEND_SLICE))
            except BlockingIOError:
                self._wait_writable(check)
                continue
            except BrokenPipeError as exc:
                raise FfmpegExited("ffmpeg closed its input early") from exc
            if n == 0:
                raise BadRequest(
                    "the source file shrank while it was being sent", code="segment_truncated"
                )
            self._progressed()
            offset += n
            count -= n

    def send(self, data: memoryview, check: Callable[[], None] = no_check) -> None:
        """Write all of ``data`` (a byte-format memoryview) into the pipe."""
        view = data
        while view:
            try:
                n = os.write(self.fd, view[:SEND_SLICE])
            except BlockingIOError:
                self._wait_writable(check)
                continue
            except BrokenPipeError as exc:
                raise FfmpegExited("ffmpeg closed its input early") from exc
            self._progressed()
            view = view[n:]
