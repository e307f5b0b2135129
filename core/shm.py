"""Host frames through POSIX shared memory, described by key, offset, dtype and shape.

A tensor that already lives in a named torch shm segment is described where it
is; anything else is copied once into a segment made here (mode 0600, flock-ed
while in use) and always unlinked, errors and KeyboardInterrupt included.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import mmap
import os
import re
import secrets
from collections.abc import Iterator
from typing import Any

from framewire.core.closing import Closing
from framewire.core.frames import Frames, MappedBuffer, describe, is_torch
from framewire.core.wire import Layout, ShmSource

SHM_PREFIX = "/framewire-"
_counter = itertools.count()
# Our segments: /framewire-<creator pid>-<counter>-<random>.
_OURS = re.compile(re.escape(SHM_PREFIX[1:]) + r"(\d+)-\d+-[0-9a-f]{8}")
_swept = False


def _torch_shm_key(video: Any) -> tuple[str, int] | None:
    """(key, byte offset) when a contiguous CPU tensor already sits in a named torch segment."""
    import torch.multiprocessing as tmp

    if not (video.is_shared() and video.is_contiguous()):
        return None
    if tmp.get_sharing_strategy() != "file_system":  # type: ignore[no-untyped-call]
        return None
    storage = video.untyped_storage()
    _, name, _ = storage._share_filename_cpu_()
    key = name.decode() if isinstance(name, bytes) else str(name)
    # torch keeps a refcount header before the data: whatever precedes the
    # storage's bytes at the end of the segment.
    try:
        header = os.stat(f"/dev/shm{key}").st_size - storage.nbytes()
    except OSError:
        return None
    if not 0 <= header <= 4096:
        return None
    return key, header + video.storage_offset() * video.element_size()


class Segment(MappedBuffer, Closing):
    """A POSIX shm segment made here: mode 0600, ``flock``-ed while it exists (so a later
    sweep can tell it from one a killed process left behind), unlinked by :meth:`close`."""

    def __init__(self, nbytes: int):
        global _swept
        if not _swept:
            _swept = True
            remove_abandoned_segments()
        self.nbytes = nbytes
        self.key = f"{SHM_PREFIX}{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"
        self._path = f"/dev/shm{self.key}"
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)  # dropped by the kernel if this process dies
            os.ftruncate(self._fd, max(nbytes, 1))
            self._map: mmap.mmap | None = mmap.mmap(self._fd, max(nbytes, 1))
        except BaseException:
            self.close()
            raise

    def source(self, frames: Frames) -> ShmSource:
        """The descriptor of ``frames`` written at the start of the segment."""
        return shm_source(self.key, 0, frames)

    def close(self) -> None:
        if getattr(self, "_map", None) is not None:
            assert self._map is not None
            self._map.close()
            self._map = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def shm_source(key: str, offset: int, frames: Frames) -> ShmSource:
    return ShmSource(
        key=key,
        offset=offset,
        dtype=frames.dtype,
        shape=list(frames.shape),
        layout=frames.layout,
        byte_size=frames.nbytes,
    )


@contextlib.contextmanager
def shared(video: Any, *, layout: Layout | str | None = None) -> Iterator[ShmSource]:
    """Yield a descriptor of ``video`` in shared memory; release what was created on exit."""
    if is_torch(video) and video.device.type != "cpu":
        raise ValueError(
            f"a tensor on {video.device} cannot go through shared memory: CUDA tensors go "
            "through CUDA IPC (share()), others must be moved to the CPU"
        )
    frames = describe(video, layout)
    if is_torch(frames.video):
        existing = _torch_shm_key(frames.video)
        if existing is not None:
            yield shm_source(*existing, frames)
            return
    with Segment(frames.nbytes) as segment:
        segment.write(frames)
        yield segment.source(frames)


def remove_abandoned_segments() -> list[str]:
    """Unlink the segments killed clients left in /dev/shm; returns their keys.

    Only names ``shared`` makes, and only when their creator's lock is free: a
    live creator holds it, also one in another PID namespace sharing /dev/shm.
    Runs once per process, at its first ``shared``; the worker runs it at start.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir("/dev/shm"))
    except OSError:
        return removed
    for entry in entries:
        found = _OURS.fullmatch(entry.name)
        if found is None:
            continue
        pid = int(found.group(1))
        if pid != os.getpid() and pid_alive(pid):
            continue  # its creator may still be using it: not even worth a look
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino == os.stat(entry.path, follow_symlinks=False).st_ino:
                os.unlink(entry.path)
                removed.append("/" + entry.name)
        except OSError:
            pass  # locked (in use), or gone already
        finally:
            os.close(fd)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a process (somebody else's counts) in this PID namespace."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
