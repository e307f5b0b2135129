"""A child process another process forked for this one (service/_encode/forks.py: the
PyAV writers a template forks), with the part of ``subprocess.Popen``'s face that
:class:`~framewire.core.media.process.FfmpegProcess` uses.

Its parent, not this process, reaps it, so its exit status comes from the parent: written
on a pipe (``"<code>\\n"``, ``os.waitstatus_to_exitcode``'s) once reaped, then closed. Its
pidfd, made by the parent before it could be reaped, signals it and never a process
that took its pid after it. A parent gone before saying (the pipe's end, no status)
leaves the child without its status: it is killed, and counts as killed (the wait for
its exit then bounded by KILLED_WITHIN_S).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess

# The status of a child whose parent ended without saying it: killed here.
LOST = -signal.SIGKILL
STATUS_BYTES = 32
KILLED_WITHIN_S = 5.0  # a killed child's exit waited for at most this long


class Adopted:
    """``pid``, its ``pidfd``, the pipe its ``status`` comes on, and ``stdin`` (the write end
    of its stdin's pipe, or -1). Its descriptors are closed once its status is known."""

    def __init__(self, pid: int, pidfd: int, status: int, stdin: int = -1):
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._status = status
        self.stdin = os.fdopen(stdin, "wb", buffering=0) if stdin >= 0 else None

    def exit_fd(self) -> int:
        """A descriptor readable once the status is there (or will never come); the
        caller's to close. OSError once the status is known (nothing left to watch)."""
        if self.returncode is not None:
            raise OSError("the child's status is known")
        return os.dup(self._status)

    def poll(self) -> int | None:
        if self.returncode is None and _readable(self._status, 0):
            self._take_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not _readable(self._status, None if timeout is None else timeout * 1e3):
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            self._take_status()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # exited: its status is coming
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def release(self) -> None:
        """Done with it: killed unless its status is known, and left to its parent to reap
        (nothing waits here); its descriptors closed. Its status, if it never came, is
        taken as killed."""
        if self.poll() is None:
            self.kill()
            self.returncode = -signal.SIGKILL
            os.close(self._status)
            os.close(self._pidfd)

    def _take_status(self) -> None:
        said = os.read(self._status, STATUS_BYTES)
        if said:
            self.returncode = int(said)
        else:  # its parent is gone and will not say: it must not run on unwatched
            self.kill()
            _readable(self._pidfd, KILLED_WITHIN_S * 1e3)  # readable at its exit
            # Orphaned, it is reaped by its new parent: this process, where it is PID 1 (a
            # container's) or a subreaper; else init, and this finds no child.
            with contextlib.suppress(ChildProcessError):
                os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG)
            self.returncode = LOST
        os.close(self._status)
        os.close(self._pidfd)


def _readable(fd: int, timeout_ms: float | None) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_ms))
