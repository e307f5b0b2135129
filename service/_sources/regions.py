"""The shared-memory region registry, after NVIDIA Triton's extension.

Three kinds of region share one namespace, as in Triton: a system region is a
named window (key, offset, byte_size) of a POSIX shm segment, opened read-only
once at registration; an fd region is the same over a descriptor a rank sent
on the fd socket (listed with the system regions, key ``fd:<name>``), mapped
when the rank sealed it against shrinking and dropped when the rank's
connection closes; a CUDA region is the first byte_size bytes of another
process's GPU allocation, mapped from its raw IPC handle at registration.
Requests lease a region. Unregistering, as in Triton, returns at once: the
region leaves the registry (status no longer lists it, new requests cannot
find it), and what it holds open is released when its last lease ends.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import mmap
import os
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from framewire.client._errors import BadRequest, NotFound, Unavailable
from framewire.service._access.peers import READ, TRUSTED, Access, Peer
from framewire.service._sources.shm import judge_fd, open_shm


class CudaOpener(Protocol):
    """What maps a CUDA region's memory (the worker's CUDA runtime, when it has a GPU)."""

    def open_region(self, handle: bytes, device_id: int, byte_size: int) -> Any: ...


@dataclass(eq=False)
class Region:
    name: str
    byte_size: int
    leases: int = field(default=0, init=False)
    removed: bool = field(default=False, init=False)  # unregistered; released at the last lease

    def status(self) -> dict[str, object]:
        raise NotImplementedError

    def check(self, access: Access) -> None:
        """Raise unless the caller may read what the region maps."""

    def release(self) -> None:
        """Let go of what registration opened (no lease holds the region any more)."""

    def retire(self) -> None:
        """Out of the registry: released now if unused, else when the last lease ends."""
        self.removed = True
        if self.leases == 0:
            self.release()


@dataclass(eq=False)
class SystemRegion(Region):
    key: str
    offset: int
    fd: int

    def status(self) -> dict[str, object]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }

    def check(self, access: Access) -> None:
        access.check(os.fstat(self.fd), READ, f"region '{self.name}' (shm {self.key!r})")

    def release(self) -> None:
        os.close(self.fd)


@dataclass(eq=False)
class FdRegion(SystemRegion):
    """Bytes behind a descriptor a rank handed over; its frames are the rank's alone."""

    sealed: bool  # F_SEAL_SHRINK: mapped, converted straight from the mapping
    owner: Peer | None
    mapping: mmap.mmap | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.sealed:
            self.mapping = mmap.mmap(
                self.fd, self.offset + self.byte_size, mmap.MAP_SHARED, mmap.PROT_READ
            )

    def check(self, access: Access) -> None:
        uid = self.owner.uid if self.owner is not None else os.getuid()
        access.check_owner(uid, f"region '{self.name}'")

    def release(self) -> None:
        if self.mapping is not None:
            # A view still alive elsewhere keeps the pages mapped until it is freed.
            with contextlib.suppress(BufferError):
                self.mapping.close()
            self.mapping = None
        super().release()


@dataclass(eq=False)
class CudaRegion(Region):
    device_id: int
    storage: Any  # a torch.UntypedStorage over the producer's allocation

    def status(self) -> dict[str, object]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}

    def release(self) -> None:
        self.storage = None


class RegionRegistry:
    def __init__(
        self,
        shm_prefixes: list[str],
        cuda: CudaOpener | None = None,
        *,
        max_regions: int = 1024,
    ):
        self.prefixes = shm_prefixes
        self.cuda = cuda
        # Each system region holds a file descriptor for as long as it is registered.
        self.max_regions = max_regions
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()  # registration runs on request threads

    def _check_new(self, name: str) -> None:
        if name in self._regions:
            raise BadRequest(
                f"shared memory region '{name}' already in manager", code="region_exists"
            )

    def _check_room(self) -> None:
        if len(self._regions) >= self.max_regions:
            raise Unavailable(
                f"{len(self._regions)} regions are registered (FRAMEWIRE_MAX_REGIONS): "
                "unregister some first",
                code="too_many_regions",
            )

    def _add(self, region: Region) -> None:
        with self._lock:
            try:
                self._check_new(region.name)  # again: another request may have won meanwhile
            except BadRequest:
                region.release()
                raise
            self._regions[region.name] = region

    def register(
        self, name: str, key: str, offset: int, byte_size: int, access: Access = TRUSTED
    ) -> None:
        """A system region: ``byte_size`` bytes at ``offset`` of shm segment ``key``."""
        self._check_new(name)
        if offset < 0 or byte_size <= 0:
            raise BadRequest("offset must be >= 0 and byte_size > 0", code="bad_region")
        self._check_room()
        fd = open_shm(key, self.prefixes)
        region = SystemRegion(name, byte_size, key, offset, fd)
        try:
            region.check(access)
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise BadRequest(
                    f"region '{name}' ({offset}+{byte_size}) exceeds segment {key} of {size} bytes",
                    code="region_out_of_bounds",
                )
        except BaseException:
            region.release()
            raise
        self._add(region)

    def register_fd(
        self, name: str, fd: int, offset: int, byte_size: int, owner: Peer | None
    ) -> FdRegion:
        """An fd region over ``fd`` (taken over: closed with the region, or now on failure)."""
        try:
            self._check_new(name)
            self._check_room()
            sealed = judge_fd(fd, offset, byte_size)
            region = FdRegion(name, byte_size, f"fd:{name}", offset, fd, sealed, owner)
        except BaseException:
            os.close(fd)
            raise
        self._add(region)
        return region

    def register_cuda(self, name: str, raw_handle: str, device_id: int, byte_size: int) -> None:
        """A CUDA region: the first ``byte_size`` bytes behind a base64 cudaIpcMemHandle_t."""
        if self.cuda is None:
            raise BadRequest(
                "this worker has no CUDA device: CUDA regions cannot be registered",
                code="cuda_unavailable",
            )
        self._check_new(name)
        if byte_size <= 0 or device_id < 0:
            raise BadRequest("device_id must be >= 0 and byte_size > 0", code="bad_region")
        try:
            handle = base64.b64decode(raw_handle, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest("raw_handle.b64 is not base64", code="bad_cuda_handle") from None
        if not handle:
            raise BadRequest("raw_handle.b64 is empty", code="bad_cuda_handle")
        storage = self.cuda.open_region(handle, device_id, byte_size)
        self._add(CudaRegion(name, byte_size, device_id, storage))

    def get(self, name: str, kind: type[Region] = Region) -> Region:
        region = self._regions.get(name)
        if region is None or not isinstance(region, kind):
            raise NotFound(
                f"unable to find shared memory region: '{name}'", code="region_not_found"
            )
        return region

    def status(
        self, name: str | None = None, kind: type[Region] = SystemRegion
    ) -> list[dict[str, object]]:
        if name is not None:
            return [self.get(name, kind).status()]
        return [r.status() for r in self._regions.values() if isinstance(r, kind)]

    @contextlib.asynccontextmanager
    async def lease(
        self, name: str, offset: int, byte_size: int, access: Access = TRUSTED
    ) -> AsyncIterator[Region]:
        """Hold region ``name`` while ``byte_size`` bytes at ``offset`` of it are in use."""
        region = self.get(name)
        if offset + byte_size > region.byte_size:
            raise BadRequest(
                f"offset {offset} + byte_size {byte_size} exceeds region '{name}' "
                f"of {region.byte_size} bytes",
                code="region_out_of_bounds",
            )
        region.check(access)
        region.leases += 1
        try:
            yield region
        finally:
            region.leases -= 1
            if region.leases == 0 and region.removed:
                region.release()

    def unregister(self, name: str | None = None, kind: type[Region] = SystemRegion) -> None:
        """Remove one region (or all) of ``kind`` at once; unknown names are not an error,
        as in Triton. A region in use is released when its last lease ends."""
        with self._lock:
            names = list(self._regions) if name is None else [name]
            for n in names:
                region = self._regions.get(n)
                if region is not None and isinstance(region, kind):
                    self._remove(region)

    def drop(self, region: Region) -> None:
        """Remove ``region`` itself, as :meth:`unregister` does, if it is still registered.

        Its registrant holds the object, not the name: once the HTTP routes have
        unregistered it, the name may already be another registrant's region."""
        with self._lock:
            if self._regions.get(region.name) is region:
                self._remove(region)

    def _remove(self, region: Region) -> None:
        del self._regions[region.name]
        region.retire()

    def close(self) -> None:
        self.unregister(kind=Region)
