"""Files handed to ffmpeg by descriptor, never by a path it would resolve itself.

An input is judged (a regular file, and for the worker: under its roots), then
opened, and ffmpeg is given ``/proc/self/fd/<n>`` with the descriptor inherited.
So ffmpeg reads exactly the file that was judged, whatever is renamed, swapped
or linked along its path afterwards. Hazards handled here:

- Opening a FIFO for reading blocks until a writer appears, and opening a
  device can have side effects: anything but a regular file is refused before
  it is opened (``stat``), and the open itself is non-blocking in case the name
  was swapped for a FIFO in between (the descriptor is checked again).
- Names are never parsed by ffmpeg: no ``file:``/``concat:`` prefixes, no
  ``%d`` patterns, nothing that looks like an option.
"""

from __future__ import annotations

import os
import stat

from framewire.core.closing import Closing
from framewire.core.errors import BadRequest, NotFound, host_error

OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def _not_regular(path: str, mode: int) -> BadRequest:
    kind = (
        "a directory"
        if stat.S_ISDIR(mode)
        else "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "not a regular file"
    )
    return BadRequest(f"input {path!r} is {kind}, not a regular file", code="not_a_regular_file")


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of the regular file at ``path``; anything else is refused."""
    name = os.fspath(path)
    try:
        mode = os.stat(name).st_mode
    except FileNotFoundError as exc:
        raise NotFound(f"input file {name!r} does not exist", code="not_found") from exc
    except OSError as exc:
        raise BadRequest(f"input {name!r}: {exc.strerror}", code="bad_path") from exc
    if not stat.S_ISREG(mode):
        raise _not_regular(name, mode)
    try:
        fd = os.open(name, OPEN_FLAGS)
    except FileNotFoundError as exc:
        raise NotFound(f"input file {name!r} does not exist", code="not_found") from exc
    except OSError as exc:
        what = f"cannot open input {name!r}"
        refused = BadRequest(f"{what}: {exc.strerror}", code="bad_path")
        raise host_error(exc, what) or refused from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # swapped since the stat
        os.close(fd)
        raise _not_regular(name, mode)
    return fd


class InputFile(Closing):
    """An open regular file for ffmpeg to read: pass :attr:`fd`, name :attr:`ffmpeg_path`."""

    def __init__(self, fd: int, name: str):
        self.fd = fd
        self.name = name  # as asked for: for messages

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> InputFile:
        return cls(open_regular(path), os.fspath(path))

    @property
    def ffmpeg_path(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    def identity(self) -> tuple[int, int, int, int]:
        """(device, inode, size, mtime) of the open file."""
        st = os.fstat(self.fd)
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
