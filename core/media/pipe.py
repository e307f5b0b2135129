"""The pipe a child reads its frames from, fed in bounded steps.

The write end is non-blocking: while the pipe is full, every send polls in short
steps, so a cancellation (``check``) gets a say even while the child reads nothing,
and its owner (core.media.process) can tell a child that stopped making progress.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import select
import termios
import time
from collections.abc import Callable

from framewire.core.errors import BadRequest

POLL_S = 0.1  # how often a blocked send or a wait looks at cancellation and progress
PIPE_BYTES = 1 << 20  # fewer wakeups per chunk than the 64 KiB default
SEND_SLICE = 16 << 20  # bytes per sendfile call
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)
# A wait on the reader's progress looks at the pipe again after READ_POLL_FIRST_S, then
# twice as long each time up to READ_POLL_S: a reader at its pipe (a one-frame chunk, a
# stream's last) takes its bytes well within the first, which a chunk's answer then waits
# for instead of a whole READ_POLL_S; a long read costs a few more looks, not one a step.
READ_POLL_S = 0.001
READ_POLL_FIRST_S = 0.0001


def no_check() -> None:
    pass


def pipe_capacity(fd: int) -> int | None:
    """Bytes a pipe can hold; None if ``fd`` is not a pipe (then assume the worst)."""
    try:
        return fcntl.fcntl(fd, F_GETPIPE_SZ)
    except OSError:
        return None


def reader_gone(fd: int) -> bool:
    """Whether the read end of the pipe behind write end ``fd`` is closed."""
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))


def pipe_unread(fd: int) -> int:
    """Bytes written into the pipe behind ``fd`` (either end) that are not read yet."""
    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count, True)
    return count[0]


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

    def wait_read(self, check: Callable[[], None] = no_check) -> None:
        """Until the reader has read every byte in the pipe: sent by ``sendfile``, they are
        references to the sender's pages, which it may write again only then. Bounded
        as a send is: each byte the reader takes is progress, ``check`` and the stall
        watch run every POLL_S; a reader gone is :class:`FfmpegExited`."""
        unread, watched = pipe_unread(self.fd), time.monotonic()
        delay = READ_POLL_FIRST_S
        while unread:
            if reader_gone(self.fd):
                raise FfmpegExited("ffmpeg closed its input early")
            time.sleep(delay)
            delay = min(2 * delay, READ_POLL_S)
            left = pipe_unread(self.fd)
            if left < unread:
                self._progressed()
            unread = left
            if time.monotonic() - watched >= POLL_S:
                self._watch(check)
                watched = time.monotonic()
        check()
