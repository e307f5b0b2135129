"""An encode's child process: started (the PyAV writer forked from its template), waited
for, and what its exit status means for the request."""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence

from framewire.core.errors import (
    BadRequest,
    Conflict,
    FramewireError,
    InsufficientStorage,
    MediaError,
)
from framewire.core.media.argv import OTHER_PYAV_EXIT, refused_input
from framewire.core.media.priority import Priority
from framewire.core.media.process import FfmpegProcess
from framewire.service._encode.forks import Forks
from framewire.service._encode.profiles import PYAV_CHILD, PYAV_TEMPLATE

Explain = Callable[[str, FramewireError], FramewireError]


class Children:
    """Starts each encode's child: ffmpeg, or the ``vllm-omni`` profile's PyAV writer
    (forked from a template started ahead, with ``pyav_fork``), and tells what its end
    means. ``explain(exe, failure)``: the answer to a failure of the child running
    ``exe`` (Encoders.explain: that the binary does not run any more, where it does not)."""

    def __init__(self, pyav_fork: bool, explain: Explain = lambda exe, failure: failure):
        self.forks = Forks(PYAV_CHILD, PYAV_TEMPLATE) if pyav_fork else None
        self.explain = explain

    def wait_for(self, ff: FfmpegProcess, check: Callable[[], None]) -> None:
        """End of frames: wait for the child to write its trailer and exit; raise if it
        failed."""
        rc = ff.wait(check)
        if rc != 0:
            failure = ffmpeg_failure(ff, rc, f"ffmpeg exited with status {rc}")
            raise self.explain(ff.argv[0], failure)

    def cut_short(self, ff: FfmpegProcess, check: Callable[[], None]) -> FramewireError:
        """What a child that stopped reading before it had every frame is answered with."""
        rc = ff.wait(check)
        failure = ffmpeg_failure(ff, rc, f"ffmpeg exited ({rc}) before it had every frame")
        return self.explain(ff.argv[0], failure)

    def start(
        self, argv: Sequence[str], fds: Sequence[int], stall_s: float | None, priority: Priority
    ) -> FfmpegProcess:
        """The child running ``argv``, inheriting ``fds``, frames to be fed on its stdin."""
        pyav = list(argv[: len(PYAV_CHILD)]) == list(PYAV_CHILD)
        if pyav and self.forks is not None:
            return self.forks.start(argv[len(PYAV_CHILD) :], fds, stall_s, priority)
        # cwd "/": a child resolves nothing (an empty PYTHONPATH entry) in the worker's.
        return FfmpegProcess(argv, pass_fds=fds, stall_s=stall_s, cwd="/", priority=priority)

    def close(self) -> None:
        if self.forks is not None:
            self.forks.close()


# What ffmpeg prints when the output cannot grow (ENOSPC, EFBIG, EDQUOT).
_NO_SPACE = ("No space left on device", "File too large", "Disk quota exceeded")


def ffmpeg_failure(ff: FfmpegProcess, rc: int, message: str) -> FramewireError:
    """What an ffmpeg that exited ``rc`` is answered with (its stderr tail as detail)."""
    tail = ff.stderr_tail()
    # SIGXFSZ: ffmpeg ran past RLIMIT_FSIZE without ignoring the signal.
    if rc == -signal.SIGXFSZ or (rc > 0 and any(s in tail for s in _NO_SPACE)):
        return InsufficientStorage(
            f"{message}: the output filesystem is full or the file exceeds a size limit",
            detail=tail,
        )
    if rc == OTHER_PYAV_EXIT:  # PyAV upgraded under the worker: not the build named
        return Conflict(f"{message}: {tail.strip()}", code="encoder_unavailable", detail=tail)
    if rc > 0 and refused_input(tail):
        return BadRequest(
            "the audio input is not an audio file of an allowed format: playlists, concat "
            "lists and image sequences are not read",
            code="input_format_refused",
            detail=tail,
        )
    return MediaError(message, code="ffmpeg_killed" if rc < 0 else "ffmpeg_failed", detail=tail)
