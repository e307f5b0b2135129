"""The ``vllm-omni`` profile's PyAV template: the writer's imports done once, a writer
forked for each encode.

    python -P .../framewire/service/_encode/pyav_template.py FD

Started ahead of the encodes (service/_encode/forks.py), it imports the writer
(pyav_writer.py, beside this file: PyAV, its parser) and forks a writer for each job
that comes on the Unix socket FD: one message, the writer's arguments as JSON, and
descriptors (``SCM_RIGHTS``): the writer's kit (``KIT``), then those its arguments
name, named again by the numbers they have here; once no writer has run for
SPARE_AFTER_S it forks one ahead (a spare), which takes the next job as it comes, the
same message passed on. A writer runs one job in a process and session of its own, and
exits: an encode never shares a process, nor anything of x264's,
with another, and the template itself never encodes. Once its output is whole and
closed a writer says so (``DONE``) before it exits, and the worker goes on without
waiting for its teardown; the template reaps it and writes its status for the worker.
Imports nothing of framewire, as the writer does.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import math
import os
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import NoReturn


def _import_writer() -> ModuleType:
    """pyav_writer.py, beside this file (``-P`` keeps this folder off sys.path)."""
    spec = importlib.util.spec_from_file_location(
        "pyav_writer", Path(__file__).with_name("pyav_writer.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


writer = _import_writer()
prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
exit_now: Callable[[int], NoReturn] = writer.exit_now  # typed: the module is loaded by path

JOB_BYTES = 1 << 16  # the job's JSON
# core.media.process.DONE, spelled here: a writer's word that its output is complete.
DONE = b"done\n"
# What comes with each job before the descriptors its arguments name: the socket its
# writer says DONE on, its stdin's and stderr's, and the pipe its exit status goes on.
KIT = 4
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15  # the name ps shows: a spare's, then a writer's
# A spare is forked this long after the last writer ended: not beside the end of its
# encode (its output's check and hand-over), whose CPU it would take.
SPARE_AFTER_S = 0.1
MAX_FDS = KIT + 8
PROC_FD = "/proc/self/fd/"


def _renumbered(argv: list[str], numbers: dict[int, int]) -> list[str]:
    """``argv`` with each descriptor it names (the output's directory or memfd, the
    audio's memfd) given the number it has here."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg.startswith(PROC_FD):  # a private directory's file, or a memfd itself
            fd, slash, rest = arg[len(PROC_FD) :].partition("/")
            out[i] = f"{PROC_FD}{numbers[int(fd)]}{slash}{rest}"
        elif i > 0 and out[i - 1] == "--audio":
            fd, _, rest = arg.partition(",")
            out[i] = f"{numbers[int(fd)]},{rest}"
    return out


def receive_job(sock: socket.socket) -> tuple[list[str], list[int]] | None:
    """A job: its arguments (naming the descriptors sent along by the numbers they have
    here) and every descriptor that came, the kit first; None when the worker let go."""
    message, fds, _, _ = socket.recv_fds(sock, JOB_BYTES, MAX_FDS)
    if not message:
        for fd in fds:
            os.close(fd)
        return None
    job = json.loads(message)
    theirs = [int(n) for n in job["fds"]]
    if len(theirs) != len(fds) - KIT:
        for fd in fds:
            os.close(fd)
        raise SystemExit("the job's descriptors did not all come")
    numbers = dict(zip(theirs, fds[KIT:], strict=True))
    return _renumbered([str(a) for a in job["argv"]], numbers), fds


class Spare:
    """A writer forked ahead, in its session already, waiting on ``sock`` for its job:
    a job given to it is answered without a fork on the encode's path (about 3 ms: the
    fork of this process and the writer's settling)."""

    def __init__(self, pid: int, pidfd: int, sock: socket.socket):
        self.pid, self.pidfd, self.sock = pid, pidfd, sock

    def alive(self) -> bool:
        exited = select.poll()
        exited.register(self.pidfd, select.POLLIN)  # readable once it has exited
        return not exited.poll(0)

    def give(self, argv: list[str], fds: list[int]) -> None:
        """Hand it the job (its descriptors as they are numbered here); it is a writer
        from here on, reaped as one."""
        message = json.dumps({"argv": argv, "fds": fds[KIT:]}).encode()
        with contextlib.suppress(OSError), self.sock:  # gone: it never had the job
            socket.send_fds(self.sock, [message], fds)

    def end(self) -> None:
        """Kill it and reap it (it holds no job: nothing is lost)."""
        self.sock.close()
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        os.close(self.pidfd)


def serve(control: socket.socket) -> int:
    """Fork a writer for each job on ``control`` (or give it to the spare forked ahead),
    answer with its pid and pidfd, reap it and write its status on the job's pipe;
    until the worker closes the socket and every writer has ended. A spare is forked
    once no writer has run for SPARE_AFTER_S (its fork never takes the CPU from an
    encode of this template's), and ended with the template."""
    poller = select.poll()
    poller.register(control, select.POLLIN)
    writers: dict[int, tuple[int, int]] = {}  # pidfd: (pid, its status pipe)
    spare: Spare | None = None
    spare_at = time.monotonic()  # when a spare is forked, if no writer runs by then
    listening = True
    while listening or writers:
        wait_ms = None
        if listening and spare is None and not writers:
            wait_ms = max(0, math.ceil((spare_at - time.monotonic()) * 1000))
            if wait_ms == 0:
                spare, wait_ms = _spare(control, writers), None
                poller.register(spare.pidfd, select.POLLIN)
        for fd, _ in poller.poll(wait_ms):
            if spare is not None and fd == spare.pidfd:  # killed before it had a job
                poller.unregister(fd)
                spare.end()
                spare = None
                continue
            if fd in writers:
                pid, status = writers.pop(fd)
                poller.unregister(fd)
                _, code = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):  # the worker let it go: nobody to tell
                    os.write(status, b"%d\n" % os.waitstatus_to_exitcode(code))
                os.close(status)
                os.close(fd)
                spare_at = time.monotonic() + SPARE_AFTER_S
                continue
            job = receive_job(control)
            if job is None:
                listening = False
                poller.unregister(control)
                continue
            argv, fds = job
            given, spare = spare, None
            if given is not None and not given.alive():
                # Ended at its own event (in this poll's list, or the next's): its pidfd
                # stays open till then, its number never another's meanwhile.
                spare, given = given, None
            if given is not None:
                pid, pidfd = given.pid, given.pidfd  # its pidfd: polled already
            else:
                pid = _fork(_given(job), control, writers)
                pidfd = os.pidfd_open(pid)  # before it can be reaped: never another's pid
                poller.register(pidfd, select.POLLIN)
            writers[pidfd] = (pid, fds[KIT - 1])
            with contextlib.suppress(OSError):  # the worker is gone: the writer's input ends
                socket.send_fds(control, [b"%d" % pid], [pidfd])
            if given is not None:
                # After the answer: woken by its job, the spare would otherwise take this
                # process's CPU (2 ms here) before the answer left. Dead by now, its status
                # (killed) is the encode's, said once it is reaped.
                given.give(argv, fds)
            for n in [*fds[: KIT - 1], *fds[KIT:]]:  # the writer's now
                os.close(n)
    if spare is not None:
        spare.end()
    return 0


def _spare(control: socket.socket, writers: dict[int, tuple[int, int]]) -> Spare:
    """A writer forked now, waiting for a job of its own."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def job() -> tuple[list[str], list[int]] | None:
        mine.close()
        prctl(PR_SET_NAME, b"pyav-spare")
        with theirs:
            return receive_job(theirs)

    try:
        pid = _fork(job, control, writers)
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()
    return Spare(pid, os.pidfd_open(pid), mine)


def _given(job: tuple[list[str], list[int]]) -> Callable[[], tuple[list[str], list[int]]]:
    """A job already received, as :func:`_fork` takes one."""
    return lambda: job


def _fork(
    job: Callable[[], tuple[list[str], list[int]] | None],
    control: socket.socket,
    writers: dict[int, tuple[int, int]],
) -> int:
    """A writer, forked: in a session of its own (its own scheduling group), holding
    only its job's descriptors, killed if the template dies (the worker learns its
    status from the template alone), it runs ``job()`` (its arguments and descriptors,
    or None: nothing to run) and exits; never returns here."""
    sys.stdout.flush()
    sys.stderr.flush()
    template = os.getpid()
    settled, settling = os.pipe()
    pid = os.fork()
    if pid:
        # Answered once the writer is in its session: the priority the worker gives its
        # group must not go to the template's.
        os.close(settling)
        os.read(settled, 1)  # its end: closed by the writer (or at its death)
        os.close(settled)
        return pid
    code = 1
    try:
        os.close(settled)
        os.setsid()
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.close(settling)
        if os.getppid() != template:
            raise SystemExit("the template ended as the writer was forked")
        control.close()
        for pidfd, (_, status) in writers.items():
            os.close(pidfd)
            os.close(status)
        given = job()
        code = 0 if given is None else _run(*given)
    except SystemExit as exc:  # as the interpreter would exit with it
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except Exception:
        traceback.print_exc()
    finally:
        exit_now(code)  # whatever happened: never back into the template's loop


def _run(argv: list[str], fds: list[int]) -> int:
    """The job, in the writer: its kit in place, the encode, DONE once its output is
    whole and closed (the worker goes on without waiting for this process's end, its
    teardown, of which the template tells it afterwards)."""
    prctl(PR_SET_NAME, b"pyav-writer")
    word, stdin, stderr, status = fds[:KIT]
    os.close(status)
    os.dup2(stdin, 0)
    os.dup2(stderr, 2)
    os.close(stdin)
    os.close(stderr)
    code: int = writer.run(argv)
    if code == 0:
        with contextlib.suppress(OSError):
            os.write(word, DONE)
    return code


if __name__ == "__main__":
    exit_now(serve(socket.socket(fileno=int(sys.argv[1]))))
