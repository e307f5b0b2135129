"""PyAV writers started ahead: the ``vllm-omni`` profile's encoder without an interpreter's
start and PyAV's import on the encode's path (about 0.1 s of an encode that may itself
take 0.1 s).

A spare is the PyAV child (service/_encode/pyav_writer.py ``--spare``) started before its
encode, in a session of its own, without a stall bound: it waits, using no CPU, on its
end of a socket pair. An encode takes one, gives it the stall bound and priority an
encode gets (:meth:`FfmpegProcess.begin`), and sends it its arguments and the
descriptors they name; a new spare is started for the next encode a moment after this
one's child has ended, so that its start (an interpreter and PyAV's import, about 0.1
CPU-s) never takes the CPU from the encode itself, nor from the hand-over of its
output. Two are kept by default: encodes back to back (the next begins before that
moment) take the second, where with one each other encode started its own on its
path. That start yields as an encode does: the spare's session (its autogroup) is
at niceness 19 until an encode takes it, whose priority it then gets, its group back
at the worker's niceness for an encode that adds none (its threads' niceness is left
alone while it waits, which an unprivileged worker could not take back; a group's it
can). Each spare runs one encode and exits, as a child started afresh does: no encode
shares a process, nor x264's state, with another. A spare that died, or cannot take
its job, is let go and the encode starts a child afresh; the worker's shutdown lets go
of those still waiting (they exit on their socket's end).
"""

from __future__ import annotations

import array
import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Sequence

from framewire.core.media.priority import Priority, group_nice
from framewire.core.media.process import FfmpegProcess

log = logging.getLogger("framewire.encode")

WAITING_NICE = 19  # a spare's session's niceness while it starts and waits
# How long after an encode's writer ended the next is started: not while its output is
# handed over. Started at once, the next writer's start (at niceness 19) slowed the
# caller's take of an 85 MB memory output in 6 of 10 saves here (its read into the
# bytes 80-101 ms against 50-52); started 0.25 s later, in none of 10 (52-69 ms).
REFILL_AFTER_S = 0.25


class Spare:
    """One writer started ahead, and the socket its job goes through."""

    def __init__(self, child: Sequence[str]):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.process = FfmpegProcess(
                [*child, "--spare", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stall_s=None,
                cwd="/",
                new_session=True,
                tracked=False,
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self.control = mine
        group_nice(self.process.proc.pid, WAITING_NICE)

    def give(self, args: Sequence[str], fds: Sequence[int]) -> bool:
        """Send the job; False if the spare cannot take it (it died)."""
        if self.process.proc.poll() is not None:
            return False
        message = json.dumps({"argv": list(args), "fds": list(fds)}).encode()
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        try:
            self.control.sendmsg([message], ancillary)
        except OSError:
            self.control.close()
            return False
        # It says on the same socket when its output is complete (before its exit).
        self.process.hears_done_on(self.control)
        return True

    def discard(self) -> None:
        """Let it go: its socket's end makes it exit; then it is reaped."""
        self.control.close()
        self.process.close()


class Spares:
    """Up to ``count`` writers of ``child`` started ahead; none until the first is asked
    for (a worker that never writes with PyAV starts none)."""

    def __init__(self, child: Sequence[str], count: int):
        self.child = list(child)
        self.count = count
        self._ready: list[Spare] = []
        self._starting = 0  # being started by a refill, not yet ready
        self._lock = threading.Lock()
        self._closed = False

    def start(
        self,
        args: Sequence[str],
        fds: Sequence[int],
        stall_s: float | None,
        priority: Priority,
    ) -> FfmpegProcess:
        """The writer for ``args`` (its arguments, after the child's command): a spare given
        the job, else a child started afresh; either way spares are started for the next
        once it has ended (beside the next encode, not this one)."""
        taken = None
        with self._lock:
            if self._ready:
                taken = self._ready.pop(0)
        process = None
        if taken is not None:
            if taken.give(args, fds):
                process = taken.process
                process.begin(stall_s, priority)
                if priority.nice <= 0:  # its group left as it waited: the worker's weight
                    group_nice(process.proc.pid, os.getpriority(os.PRIO_PROCESS, 0))
            else:
                taken.discard()
        if process is None:
            process = FfmpegProcess(
                [*self.child, *args],
                pass_fds=list(fds),
                stall_s=stall_s,
                cwd="/",
                priority=priority,
            )
        process.after_close(self._refill_soon)
        return process

    def _refill_soon(self) -> None:
        """Refill off the thread that ends the encode (its answer does not wait on a fork),
        :data:`REFILL_AFTER_S` after it ended."""
        timer = threading.Timer(REFILL_AFTER_S, self._refill)
        timer.name, timer.daemon = "framewire-spares", True
        timer.start()

    def _refill(self) -> None:
        """Start writers until ``count`` are ready (a refill beside this one counts those
        it is starting)."""
        while True:
            with self._lock:
                if self._closed or len(self._ready) + self._starting >= self.count:
                    return
                self._starting += 1
            try:
                spare = Spare(self.child)
            except Exception as exc:  # the next encode starts its child afresh and says why
                with self._lock:
                    self._starting -= 1
                log.warning("cannot start a PyAV writer ahead: %s", exc)
                return
            with self._lock:
                self._starting -= 1
                kept = not self._closed
                if kept:
                    self._ready.append(spare)
            if not kept:
                spare.discard()
                return

    def close(self) -> None:
        """Let go of every spare still waiting (a shutdown)."""
        with self._lock:
            self._closed = True
            spares, self._ready = self._ready, []
        for spare in spares:
            with contextlib.suppress(Exception):
                spare.discard()
