"""Host frames handed to the worker as descriptors over its fd socket (docs/api.md).

No name is made in /dev/shm, so the worker and the rank need not share an IPC
namespace (two containers that share one volume for the sockets will do), and
nothing outlives the rank: its regions go when its connection to the fd
socket closes. Frames are copied once into a memfd sealed against shrinking
(the worker then maps it and converts in place); a tensor already in torch
shared memory is handed over as it is, with no copy (the worker reads it with
``pread``, as it cannot know that nobody will shrink it).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import mmap
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from framewire.client._closing import Closing
from framewire.client._errors import Overloaded, Unavailable
from framewire.client._fdsocket import FdSocket, error_from
from framewire.client._sharing.shm import shared
from framewire.client._sharing.video import Frames, MappedBuffer, describe, is_torch
from framewire.client.wire import Layout, RegionSource, ShmSource

_names = itertools.count()
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# What a refused ``register`` raises when the worker has no room (region slots, the
# caller's quota, descriptors): the frames can still go through a named segment.
NO_ROOM = (Unavailable, Overloaded)


class FdRegions(Closing):
    """One connection to the worker's fd socket, and the regions registered over it.

    Safe to share between threads (one request at a time). Closing it, or this
    process ending, drops every region it registered.
    """

    def __init__(self, path: str | os.PathLike[str], timeout: float | None):
        self.path = Path(path)
        self._conn = FdSocket(path, timeout)
        self._lock = threading.Lock()
        self.broken = False  # the connection was lost: its regions are gone
        try:
            pong = self._call({"op": "ping"})
        except BaseException:
            self._conn.close()
            raise
        self.instance = pong.instance  # the worker process that holds the regions

    def _call(self, message: dict[str, Any], fd: int | None = None) -> Any:
        with self._lock:
            try:
                reply, extra = self._conn.call(message, fd)
            except Unavailable:
                self.broken = True
                raise
        if extra is not None:
            os.close(extra)
        if not reply.ok:
            raise error_from(reply)
        return reply

    def register(self, fd: int, offset: int, byte_size: int) -> str:
        """Region over ``byte_size`` bytes at ``offset`` of ``fd`` (which stays the caller's)."""
        name = f"fw-{os.getpid()}-{next(_names)}-{secrets.token_hex(4)}"
        self._call({"op": "register", "name": name, "offset": offset, "byte_size": byte_size}, fd)
        return name

    def unregister(self, name: str) -> None:
        self._call({"op": "unregister", "name": name})

    def close(self) -> None:
        self._conn.close()


class Memfd(MappedBuffer, Closing):
    """A memfd of ``nbytes`` sealed against shrinking and growing, mapped for writing."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.fd = os.memfd_create("framewire-frames", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, max(nbytes, 1))
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
            self._map: mmap.mmap | None = mmap.mmap(self.fd, max(nbytes, 1))
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class RegisteredMemfd(Memfd):
    """A :class:`Memfd` registered as a region: what the stream writer reuses per chunk."""

    def __init__(self, nbytes: int, regions: FdRegions):
        super().__init__(nbytes)
        self.regions = regions
        try:
            self.name = regions.register(self.fd, 0, max(nbytes, 1))
        except BaseException:
            super().close()
            raise

    def source(self, frames: Frames) -> RegionSource:
        return region_source(self.name, frames)

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(Exception):  # gone with the connection already
                self.regions.unregister(self.name)
        super().close()


def region_source(name: str, frames: Frames) -> RegionSource:
    return RegionSource(
        region=name,
        offset=0,
        dtype=frames.dtype,
        shape=list(frames.shape),
        layout=frames.layout,
        byte_size=frames.nbytes,
    )


@contextlib.contextmanager
def fd_shared(
    video: Any, regions: FdRegions, *, layout: Layout | str | None = None
) -> Iterator[RegionSource | ShmSource]:
    """Yield a region descriptor of host ``video``; unregistered (and freed) on exit.

    A worker without room for the region is handed a named segment instead."""
    if is_torch(video) and video.device.type != "cpu":
        raise ValueError(f"a tensor on {video.device} cannot be handed over as a descriptor")
    frames = describe(video, layout)
    existing = _torch_shared_fd(frames.video) if is_torch(frames.video) else None
    name: str | None = None
    memfd: RegisteredMemfd | None = None
    try:
        if existing is None:
            memfd = RegisteredMemfd(frames.nbytes, regions)
        else:
            name = regions.register(existing[0], existing[1], frames.nbytes)
    except NO_ROOM:
        pass  # below: a named segment
    finally:
        if existing is not None and existing[2]:
            os.close(existing[0])  # ours to close, registered or not
    if memfd is not None:
        with memfd:
            memfd.write(frames)
            yield memfd.source(frames)
    elif name is not None:
        try:
            yield region_source(name, frames)
        finally:
            with contextlib.suppress(Exception):
                regions.unregister(name)
    else:
        with shared(video, layout=layout) as src:
            yield src


def _torch_shared_fd(video: Any) -> tuple[int, int, bool] | None:
    """(fd, byte offset, whether the fd is ours to close) of a contiguous CPU tensor
    already in torch shared memory (``share_memory_()``), else None."""
    if not (video.is_shared() and video.is_contiguous()):
        return None
    import torch.multiprocessing as tmp

    storage = video.untyped_storage()
    if tmp.get_sharing_strategy() == "file_descriptor":  # type: ignore[no-untyped-call]
        fd, _ = storage._share_fd_cpu_()
        owned = False  # the storage's own
    else:
        _, name, _ = storage._share_filename_cpu_()
        key = name.decode() if isinstance(name, bytes) else str(name)
        try:
            fd = os.open(f"/dev/shm{key}", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        owned = True
    # torch may keep a header (a refcount) before the storage's bytes in the file.
    header = os.fstat(fd).st_size - storage.nbytes()
    if not 0 <= header <= 4096:
        if owned:
            os.close(fd)
        return None
    return fd, header + video.storage_offset() * video.element_size(), owned
