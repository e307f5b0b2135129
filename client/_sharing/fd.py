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

from framewire.core.closing import Closing
from framewire.core.errors import NotFound, Overloaded, Unavailable
from framewire.core.fdsocket import ConnectionLost, FdSocket, error_from
from framewire.core.frames import (
    Frames,
    MappedBuffer,
    contiguous_bytes,
    describe,
    is_torch,
)
from framewire.core.shm import shared
from framewire.core.wire import Layout, RegionSource, ShmSource

_names = itertools.count()
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14; Python 3.11 lacks it
# What a refused ``register`` raises when the worker has no room (region slots, the
# caller's quota, descriptors): the frames can still go through a named segment.
NO_ROOM = (Unavailable, Overloaded)


class Registration:
    """A region this client registered: what it covers, and its name now (a new one
    each time the region is registered again on a new connection)."""

    def __init__(self, name: str, fd: int, offset: int, byte_size: int):
        self.name = name
        self.fd = os.dup(fd)  # ours: the region can be registered again after a reconnect
        self.offset = offset
        self.byte_size = byte_size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _new_name() -> str:
    return f"fw-{os.getpid()}-{next(_names)}-{secrets.token_hex(4)}"


class FdRegions(Closing):
    """A connection to the worker's fd socket, and the regions registered over it.

    Safe to share between threads (one request at a time). The worker keeps an idle
    connection open, so its regions stay while a rank generates; when the connection
    is gone (the worker restarted, or closed it), :meth:`refresh` (a client looks
    before each call) or a request that breaks on it connects again and registers
    every held region again first. Closing it, or this process ending, drops every
    region it registered.
    """

    def __init__(
        self, path: str | os.PathLike[str], timeout: float | None, *, worker_uid: int | None = None
    ):
        self.path = Path(path)
        self.timeout = timeout
        self.worker_uid = worker_uid  # whose socket it must be (core.trust), on each connect
        self._lock = threading.Lock()
        self._held: set[Registration] = set()
        self.broken = False  # no connection could be made again: its regions are gone
        self._conn, self.instance = self._connect()  # instance: the worker holding them

    def _connect(self) -> tuple[FdSocket, str | None]:
        conn = FdSocket(self.path, self.timeout, worker_uid=self.worker_uid)
        try:
            pong = self._checked(conn, {"op": "ping"})
        except BaseException:
            conn.close()
            raise
        return conn, pong.instance

    @staticmethod
    def _checked(conn: FdSocket, message: dict[str, Any], fd: int | None = None) -> Any:
        reply, extra = conn.call(message, fd)
        if extra is not None:
            os.close(extra)
        if not reply.ok:
            raise error_from(reply)
        return reply

    def _reconnect(self) -> None:
        """A new connection, with every held region registered on it (lock held)."""
        self._conn.close()
        try:
            self._conn, self.instance = self._connect()
            for held in self._held:
                name = _new_name()
                message = {
                    "op": "register",
                    "name": name,
                    "offset": held.offset,
                    "byte_size": held.byte_size,
                }
                self._checked(self._conn, message, held.fd)
                held.name = name
        except Unavailable:
            self.broken = True
            raise
        self.broken = False

    def stale(self) -> bool:
        """Whether :meth:`refresh` has work to do, seen without waiting (a poll): also
        when a request of another thread holds the connection now, as refresh() then
        waits its turn and looks again."""
        if not self._lock.acquire(blocking=False):
            return True
        try:
            return self.broken or self._conn.stale()
        finally:
            self._lock.release()

    def refresh(self) -> None:
        """Connect again now if the worker closed the connection (raises Unavailable
        when no worker answers there any more)."""
        with self._lock:
            if self.broken or self._conn.stale():
                self._reconnect()

    def _call(self, message: dict[str, Any], fd: int | None = None) -> Any:
        # The connection is looked at once per call of the client (refresh); a request on
        # one the worker closed since breaks, and goes again on a new one, below.
        with self._lock:
            if self.broken:
                self._reconnect()
            try:
                return self._checked(self._conn, message, fd)
            except ConnectionLost:
                # Lost under this request. Every fd-socket request may go again on a new
                # connection: a register's region went with the old connection, and so
                # would an unregistered one; ping and decode only read.
                self._reconnect()
                return self._checked(self._conn, message, fd)

    def register(self, fd: int, offset: int, byte_size: int) -> Registration:
        """Region over ``byte_size`` bytes at ``offset`` of ``fd`` (which stays the caller's)."""
        held = Registration(_new_name(), fd, offset, byte_size)
        try:
            message = {
                "op": "register",
                "name": held.name,
                "offset": offset,
                "byte_size": byte_size,
            }
            self._call(message, fd)
        except BaseException:
            held.close()
            raise
        with self._lock:
            self._held.add(held)
        return held

    def unregister(self, held: Registration) -> None:
        with self._lock:
            self._held.discard(held)
        held.close()
        try:
            self._call({"op": "unregister", "name": held.name})
        except NotFound:
            pass  # gone with an earlier connection already

    def close(self) -> None:
        with self._lock:
            for held in self._held:
                held.close()
            self._held.clear()
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
        self._filled = 0  # bytes from the start that the memfd holds pages for
        self._mapped = 0  # of them, in this process's page tables

    def write(self, frames: Frames) -> None:
        """Copy ``frames``' bytes to the start. A contiguous clip reaching past the pages
        the memfd holds goes with ``pwrite``: the kernel fills each new page whole, where
        a store through the mapping faults it in and zeroes it first (0.05 against 0.085
        CPU-s for 140 MB). Within them (a chunk buffer reused), the copy goes through the
        mapping, its pages entered first in one call (:meth:`_map_pages`)."""
        raw = contiguous_bytes(frames.video)
        if raw is not None and len(raw) > self._filled:
            done = 0
            while done < len(raw):
                done += os.pwrite(self.fd, raw[done:], done)
            self._filled = len(raw)
            return
        self._map_pages()
        super().write(frames)
        self._filled = max(self._filled, frames.nbytes)
        self._mapped = max(self._mapped, frames.nbytes)

    def _map_pages(self) -> None:
        """Enter the pages the memfd holds into the mapping at once, so that a store
        through it takes no fault: page by page, the first copy into a reused 9.6 MB
        chunk buffer took 2.9 ms (2340 faults; 4-5 ms on busy cores), mapped first 0.9 +
        0.4 ms. A shared memfd's pages are mapped writable by a read. A kernel older than
        5.14 refuses the advice: the faults are taken as before."""
        if self._map is None or self._mapped >= self._filled:
            return
        with contextlib.suppress(OSError):
            self._map.madvise(MADV_POPULATE_READ, 0, self._filled)
        self._mapped = self._filled

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
            self.registration = regions.register(self.fd, 0, max(nbytes, 1))
        except BaseException:
            super().close()
            raise

    def source(self, frames: Frames) -> RegionSource:
        return region_source(self.registration.name, frames)

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(Exception):  # gone with the connection already
                self.regions.unregister(self.registration)
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
    held: Registration | None = None
    memfd: RegisteredMemfd | None = None
    try:
        if existing is None:
            memfd = RegisteredMemfd(frames.nbytes, regions)
        else:
            held = regions.register(existing[0], existing[1], frames.nbytes)
    except NO_ROOM:
        pass  # below: a named segment
    finally:
        if existing is not None and existing[2]:
            os.close(existing[0])  # ours to close, registered or not
    if memfd is not None:
        with memfd:
            memfd.write(frames)
            yield memfd.source(frames)
    elif held is not None:
        try:
            yield region_source(held.name, frames)
        finally:
            with contextlib.suppress(Exception):
                regions.unregister(held)
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
