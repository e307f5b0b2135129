"""One ffmpeg child process, from start to reaping, with every wait bounded.

Encodes (frames fed on stdin) and decodes (frames written to an inherited
memfd) both run ffmpeg through :class:`FfmpegProcess`. Hazards handled here:

- stderr goes into a private memfd, not a pipe: ffmpeg can never block on it,
  no reader thread is needed, and its tail is at hand for every failure.
- stdin is a non-blocking pipe. Every send and every wait for the exit polls in
  short steps, so ``check`` (cancellation) gets a say even while ffmpeg reads
  nothing, and a child that stops making progress is noticed.
- "No progress" means: for ``stall_s`` seconds, the pipe took no byte and the
  child used no CPU time. A stopped process (SIGSTOP), one blocked opening a
  FIFO, or one waiting on a playlist that never ends all look like this; a
  busy encoder (x264's lookahead flush can take seconds) does not. Such a child
  is killed and :class:`Stalled` raised.
- ``close`` kills and reaps whatever state the child is in, so no zombie and
  no fd outlives the object.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

from framewire.core.closing import Closing
from framewire.core.errors import Stalled, Unavailable
from framewire.core.media.adopted import Adopted
from framewire.core.media.binary import exe_fd
from framewire.core.media.pipe import POLL_S, PipeWriter, no_check
from framewire.core.media.priority import FULL, Priority, lower_priority
from framewire.core.media.procstat import stat_fields

STDERR_TAIL = 4096


def resolve_ffmpeg(configured: str | None = None) -> str:
    """The configured executable (a path or a name on PATH), else imageio-ffmpeg's binary.

    The worker and the client's local decode both resolve it here, so the two
    routes run one binary.
    """
    if configured:
        found = shutil.which(configured)
        if found is None:
            raise Unavailable(f"ffmpeg executable {configured!r} not found", code="ffmpeg_missing")
        return os.path.abspath(found)
    try:
        import imageio_ffmpeg
    except ImportError as exc:
        raise Unavailable(
            "no ffmpeg: set FRAMEWIRE_FFMPEG or install imageio-ffmpeg", code="ffmpeg_missing"
        ) from exc
    try:
        return str(imageio_ffmpeg.get_ffmpeg_exe())
    except RuntimeError as exc:
        raise Unavailable(str(exc), code="ffmpeg_missing") from exc


def find_ffmpeg() -> str:
    """FRAMEWIRE_FFMPEG, else imageio-ffmpeg's binary: the worker's choice too."""
    return resolve_ffmpeg(os.environ.get("FRAMEWIRE_FFMPEG"))


# Every ffmpeg child alive in this process, so a shutdown can stop them all at once.
_running: set[FfmpegProcess] = set()
_running_lock = threading.Lock()


def kill_running() -> int:
    """Kill every ffmpeg child still running (their owners clean up); returns how many."""
    with _running_lock:
        procs = list(_running)
    for ff in procs:
        ff.kill()
    return len(procs)


def _tail(fd: int, limit: int) -> str:
    if fd < 0:
        return ""
    size = os.fstat(fd).st_size
    start = max(0, size - limit)
    return os.pread(fd, size - start, start).decode("utf-8", "replace").strip()


def cpu_ticks(pid: int) -> int | None:
    """User plus system CPU time of ``pid`` in clock ticks; None once it cannot be read."""
    fields = stat_fields(pid)
    try:
        return None if fields is None else int(fields[11]) + int(fields[12])  # fields 14, 15
    except (IndexError, ValueError):
        return None


# A child this process started, or one forked for it by another (a template).
Child = subprocess.Popen[bytes] | Adopted

# What a child that says so (a PyAV writer forked from its template) writes on its socket
# once its output is complete and closed, before it exits.
DONE = b"done\n"


class _ExitWatch:
    """A pidfd in a poll set: readable once the process has exited; and the socket on
    which the child says it is done, if it does."""

    def __init__(self, pidfd: int, word: socket.socket | None):
        self.fd = pidfd
        self._word = word
        self._poll = select.poll()
        self._poll.register(pidfd, select.POLLIN)
        if word is not None:
            self._poll.register(word, select.POLLIN)

    def poll(self, timeout_ms: float) -> bool:
        """True once the child has exited, or said it is done."""
        return any(fd == self.fd or self._said_done() for fd, _ in self._poll.poll(timeout_ms))

    def _said_done(self) -> bool:
        assert self._word is not None
        try:
            said = self._word.recv(len(DONE), socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            said = b""
        if said != DONE:  # it closed without the word (it failed, or died): its exit tells
            self._poll.unregister(self._word)
            self._word = None
        return said == DONE

    def close(self) -> None:
        os.close(self.fd)


def _exit_watch(proc: Child, word: socket.socket | None) -> _ExitWatch | None:
    """A watch on ``proc``'s exit (and ``word``), or None where pidfds are not to be had
    (Linux < 5.3: then only the exit ends a wait). An adopted child's exit is its status's
    coming (its parent reaps it)."""
    try:
        fd = proc.exit_fd() if isinstance(proc, Adopted) else os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        return None
    return _ExitWatch(fd, word)


class FfmpegProcess(Closing):
    """One ffmpeg child. ``stdin=True``: frames are fed through :attr:`input`.

    ``stall_s``: seconds without progress before the child is killed (None: never).
    ``file_size_limit``: RLIMIT_FSIZE for the child, so the kernel stops an output
    at that size (set right after the start, before ffmpeg has opened anything).
    ``priority``: how the child yields the CPU, set right after the start too: its
    encoder's threads, made later, inherit it; a yielding child runs in a session, and
    so a scheduling group, of its own (``new_session`` says otherwise). ``tracked``:
    among the children a shutdown kills (the PyAV template is not: it runs no encode).
    ``spawn``: the child started otherwise than by ``argv`` (forked by a template, which
    sets its session), given the stderr memfd; ``argv`` names it in messages.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        stdin: bool = True,
        stdout: bool = False,
        pass_fds: Sequence[int] = (),
        stall_s: float | None = None,
        file_size_limit: int | None = None,
        cwd: str | None = None,
        priority: Priority = FULL,
        new_session: bool | None = None,
        tracked: bool = True,
        spawn: Callable[[int], Adopted] | None = None,
    ):
        self.argv = list(argv)
        self.stall_s = stall_s
        self._after_close: list[Callable[[], None]] = []
        self._word: socket.socket | None = None  # where the child says DONE, if it does
        self._stderr = os.memfd_create("framewire-ffmpeg-stderr", os.MFD_CLOEXEC)
        # stdout, when it is wanted (``-version``), goes to a memfd too, for the same reason.
        self._stdout = os.memfd_create("framewire-ffmpeg-stdout", os.MFD_CLOEXEC) if stdout else -1
        run_from = exe_fd(self.argv[0])  # a binary run from its descriptor: the child's too
        if run_from is not None:
            pass_fds = [*pass_fds, run_from]
        self.proc: Child
        try:
            if spawn is not None:
                self.proc = spawn(self._stderr)
            else:
                self.proc = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                    stdout=self._stdout if stdout else subprocess.DEVNULL,
                    stderr=self._stderr,
                    close_fds=True,
                    pass_fds=tuple(pass_fds),
                    cwd=cwd,
                    # A yielding encoder is a scheduling group of its own (group_nice): the
                    # worker ends it itself, a terminal's signals are not its to get.
                    start_new_session=priority.yields if new_session is None else new_session,
                )
        except OSError as exc:
            self._close_memfds()
            raise Unavailable(
                f"cannot run ffmpeg {self.argv[0]!r}: {exc.strerror or exc}", code="ffmpeg_missing"
            ) from exc
        if file_size_limit is not None:
            # If it cannot be set (ffmpeg gone already, a sandbox that forbids it), the
            # caller's own size check still refuses an output past the bound.
            with contextlib.suppress(OSError):
                limit = (file_size_limit, file_size_limit)
                resource.prlimit(self.proc.pid, resource.RLIMIT_FSIZE, limit)
        if priority.yields:
            lower_priority(self.proc.pid, priority)
        self._ticks = cpu_ticks(self.proc.pid)
        self._progress_at = time.monotonic()
        self.input: PipeWriter | None = None
        if self.proc.stdin is not None:
            self.input = PipeWriter(
                self.proc.stdin.fileno(), watch=self._watch, progressed=self._progressed
            )
        if tracked:
            with _running_lock:
                _running.add(self)

    def hears_done_on(self, sock: socket.socket) -> None:
        """The child says :data:`DONE` on ``sock`` once its output is complete, before it
        exits: :meth:`wait` returns 0 at the word, and the child's teardown (5-10 ms for
        a PyAV writer) runs beside what its caller does next. :meth:`close` reaps it as
        ever, and closes ``sock``."""
        self._word = sock

    def _progressed(self) -> None:
        self._progress_at = time.monotonic()

    def _watch(self, check: Callable[[], None]) -> None:
        """Between polls: the caller's check, then the stall check."""
        check()
        if self.stall_s is None:
            return
        ticks = cpu_ticks(self.proc.pid)
        if ticks is not None and ticks != self._ticks:
            self._ticks = ticks
            self._progressed()
        elif time.monotonic() - self._progress_at > self.stall_s:
            self.kill()
            raise Stalled(
                f"ffmpeg made no progress for {self.stall_s:g} s (FRAMEWIRE_STALL_TIMEOUT_S) "
                "and was stopped",
                detail=self.stderr_tail() or None,
            )

    def close_stdin(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()

    def wait(self, check: Callable[[], None] = no_check) -> int:
        """Close stdin (end of frames) and wait for ffmpeg to exit (or say it is done:
        :meth:`hears_done_on`); returns its status.

        x264's lookahead can hold many frames, so the flush after the last one may
        take seconds: ``check`` runs while waiting and may raise (cancellation);
        the caller's ``close`` then kills ffmpeg.
        """
        self.close_stdin()
        self._progressed()  # the flush begins now
        exited = _exit_watch(self.proc, self._word)
        try:
            while True:
                if exited is not None:
                    # Woken the moment it exits. Popen.wait(timeout=) polls with sleeps
                    # that grow to 50 ms: that much latency on every short encode.
                    if exited.poll(POLL_S * 1e3):
                        # Done, said before its exit: 0, as its exit will be (main's
                        # return); close() reaps it.
                        return 0 if self.proc.poll() is None else self.proc.wait()
                else:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        return self.proc.wait(timeout=POLL_S)
                self._watch(check)
        finally:
            if exited is not None:
                exited.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    def stderr_tail(self, limit: int = STDERR_TAIL) -> str:
        return _tail(self._stderr, limit)

    def stdout_text(self, limit: int = STDERR_TAIL) -> str:
        """The end of what ffmpeg printed on stdout (``stdout=True``)."""
        return _tail(self._stdout, limit)

    def stdout_bytes(self, limit: int = 1 << 20) -> bytes:
        """What ffmpeg wrote on stdout (``stdout=True``), its first ``limit`` bytes."""
        if self._stdout < 0:
            return b""
        return os.pread(self._stdout, min(limit, os.fstat(self._stdout).st_size), 0)

    def _close_memfds(self) -> None:
        for name in ("_stderr", "_stdout"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    def after_close(self, then: Callable[[], None]) -> None:
        """Run ``then`` once the child is reaped (by :meth:`close`)."""
        self._after_close.append(then)

    def close(self) -> None:
        """Kill if still running, reap (an adopted child: its parent does), release the
        stderr memfd. Idempotent."""
        self.kill()
        self.close_stdin()
        if isinstance(self.proc, Adopted):
            self.proc.release()
        else:
            self.proc.wait()
        if self._word is not None:
            self._word.close()
            self._word = None
        with _running_lock:
            _running.discard(self)
        self._close_memfds()
        while self._after_close:
            self._after_close.pop()()
