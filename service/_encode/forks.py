"""PyAV writers forked from a template: the ``vllm-omni`` profile's encoder without an
interpreter's start and PyAV's import on the encode's path (about 0.1 CPU-s of an
encode that may itself take 0.1 s); a job's answer takes 2-3 ms where the template
forks the writer then, about 0.6 ms where a spare it forked ahead takes the job.

The template (service/_encode/pyav_template.py, which imports pyav_writer.py) is started
once, after the worker's first PyAV encode has ended (so its start never takes the CPU
from that encode, nor from its output's hand-over). It is part of the worker: in its
session (its scheduling group) and at its niceness, so that its forks and the statuses
it reports, both on an encode's path, are never starved behind the ranks (at niceness
19 they waited 66 ms and 112 ms for it beside two busy loops); its start, 0.1 CPU-s,
comes once. Each encode sends it its arguments and descriptors: the frames' pipe, the
stderr memfd, the pipe its status comes on, the socket its writer says DONE on, and
those its arguments name. The template forks the writer (or has forked it ahead: a
spare, once no writer has run for a while), which makes a session (a scheduling
group) of its own before the template answers, runs this one encode, and exits: no
encode shares a process, nor x264's state, with another, and the template never
encodes. The worker gives the writer the stall bound and priority an encode
gets, kills it through its pidfd, and lets the template reap it and say its status
(core/media/adopted.py): once the writer has said its output is whole, nothing waits
for its exit. A template that died, or does not answer, is let go (its writers die
with it: each is killed at its parent's death) and the encode starts its writer
afresh; another template is started after that encode. The worker's shutdown lets the
template go.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Sequence

from framewire.core.errors import Unavailable
from framewire.core.media.adopted import Adopted
from framewire.core.media.priority import Priority, group_nice
from framewire.core.media.process import FfmpegProcess

log = logging.getLogger("framewire.encode")

# How long after the first encode's writer ended the template is started: not while its
# output is handed over. Started at once, a writer's start (an interpreter and PyAV's
# import, even at niceness 19) slowed the caller's take of an 85 MB memory output in 6
# of 10 saves here (its read into the bytes 80-101 ms against 50-52); started 0.25 s
# later, in none of 10 (52-69 ms).
START_AFTER_S = 0.25
ANSWER_WITHIN_S = 5.0  # a template's answer to a job (its fork) waited for at most this
GONE_WITHIN_S = 1.0  # a template let go exits this soon, or is killed
# Templates let go one after another without a writer forked between them: no more are
# started (a host where forking cannot work would otherwise start one after each encode).
GIVE_UP_AFTER = 3


def pidfds_work() -> bool:
    """Whether this process may make a pidfd and signal through it (Linux 5.3, and a
    seccomp profile that allows both: older container runtimes' refuse them). The
    template makes its writers' pidfds under the same profile."""
    try:
        fd = os.pidfd_open(os.getpid())
    except (AttributeError, OSError):
        return False
    try:
        signal.pidfd_send_signal(fd, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


class Template:
    """The template process, and the socket jobs go through (one at a time)."""

    def __init__(self, template: Sequence[str]):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.process = FfmpegProcess(
                [*template, str(theirs.fileno())],
                stdin=False,
                pass_fds=[theirs.fileno()],
                stall_s=None,
                cwd="/",
                new_session=False,
                tracked=False,
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        mine.settimeout(ANSWER_WITHIN_S)
        self.control = mine
        self._lock = threading.Lock()

    def fork(self, args: Sequence[str], fds: Sequence[int], word: int, stderr: int) -> Adopted:
        """A writer forked for the job ``args`` (inheriting ``fds``), saying DONE on
        ``word``, its stderr ``stderr``; OSError where the template cannot (it is gone,
        or did not answer: let it go)."""
        stdin, feed = os.pipe2(os.O_CLOEXEC)
        status_read, status = os.pipe2(os.O_CLOEXEC)
        kit = [word, stdin, stderr, status]
        message = json.dumps({"argv": list(args), "fds": list(fds)}).encode()
        try:
            with self._lock:
                socket.send_fds(self.control, [message], [*kit, *fds])
                pid, pidfd = self._answer()
        except BaseException:
            os.close(feed)
            os.close(status_read)
            raise
        finally:
            os.close(stdin)
            os.close(status)
        return Adopted(pid, pidfd, status_read, feed)

    def _answer(self) -> tuple[int, int]:
        """The forked writer's pid and pidfd."""
        said, fds, _, _ = socket.recv_fds(self.control, 32, 1)
        if not said or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise OSError("the PyAV template ended without forking the writer")
        return int(said), fds[0]

    def discard(self) -> None:
        """Let it go: its socket's end makes it exit once its writers have; a template
        that does not is killed (and its writers with it). Then it is reaped."""
        self.control.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.proc.wait(timeout=GONE_WITHIN_S)
        self.process.close()


class Forks:
    """Writers forked from the process ``template`` runs, else ``child`` started afresh; no
    template until the first PyAV encode has ended (a worker that never writes with PyAV
    starts none)."""

    def __init__(self, child: Sequence[str], template: Sequence[str]):
        self.child = list(child)
        self.template = list(template)
        self._template: Template | None = None
        self._starting = False
        self._lock = threading.Lock()
        self._closed = False
        self._failed = 0  # templates let go since a writer was last forked
        self._works = pidfds_work()
        if not self._works:
            log.warning("no pidfds here: PyAV writers are started afresh, none forked")

    def start(
        self,
        args: Sequence[str],
        fds: Sequence[int],
        stall_s: float | None,
        priority: Priority,
    ) -> FfmpegProcess:
        """The writer for ``args`` (its arguments, after the child's command): forked from
        the template, else started afresh (then a template is started once it ended)."""
        with self._lock:
            template = self._template
        if template is not None:
            forked = self._forked(template, args, fds, stall_s, priority)
            if forked is not None:
                return forked
        process = FfmpegProcess(
            [*self.child, *args], pass_fds=list(fds), stall_s=stall_s, cwd="/", priority=priority
        )
        if not self._given_up():
            process.after_close(self._start_soon)
        return process

    def _given_up(self) -> bool:
        """No template is started any more (none can fork here)."""
        return not self._works or self._failed >= GIVE_UP_AFTER

    def _forked(
        self,
        template: Template,
        args: Sequence[str],
        fds: Sequence[int],
        stall_s: float | None,
        priority: Priority,
    ) -> FfmpegProcess | None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = FfmpegProcess(
                [*self.child, *args],
                stall_s=stall_s,
                priority=priority,
                spawn=lambda stderr: template.fork(args, fds, theirs.fileno(), stderr),
            )
        except Unavailable as exc:
            mine.close()
            log.warning("the PyAV template did not fork a writer (%s): one started afresh", exc)
            self._let_go(template)
            return None
        finally:
            theirs.close()
        process.hears_done_on(mine)
        self._failed = 0
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        if priority.nice <= 0 and nice != 0:  # its own group, at the worker's weight
            group_nice(process.proc.pid, nice)
        return process

    def _let_go(self, template: Template) -> None:
        with self._lock:
            if self._template is template:
                self._template = None
                self._failed += 1
                if self._failed == GIVE_UP_AFTER:
                    log.warning(
                        "%d PyAV templates in a row forked no writer: none is started again, "
                        "writers are started afresh",
                        GIVE_UP_AFTER,
                    )
        template.discard()

    def _start_soon(self) -> None:
        """Start the template off the thread that ends the encode (its answer does not
        wait on a fork), :data:`START_AFTER_S` after it ended."""
        timer = threading.Timer(START_AFTER_S, self._start_template)
        timer.name, timer.daemon = "framewire-forks", True
        timer.start()

    def _start_template(self) -> None:
        with self._lock:
            if self._closed or self._starting or self._template is not None or self._given_up():
                return
            self._starting = True
        template = None
        try:
            template = Template(self.template)
        except Exception as exc:  # the next encode starts its writer afresh
            log.warning("cannot start the PyAV template: %s", exc)
        with self._lock:
            self._starting = False
            kept = template is not None and not self._closed
            if kept:
                self._template = template
        if template is not None and not kept:
            template.discard()

    def close(self) -> None:
        """Let the template go (a shutdown: no encode runs)."""
        with self._lock:
            self._closed = True
            template, self._template = self._template, None
        if template is not None:
            with contextlib.suppress(Exception):
                template.discard()
