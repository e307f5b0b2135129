"""The shared-memory region registry, after NVIDIA Triton's extension.

Two kinds of region share one namespace, as in Triton: a system region is a
named window (key, offset, byte_size) of a POSIX shm segment, opened read-only
once at registration; a CUDA region is the first byte_size bytes of another
process's GPU allocation, mapped from its raw IPC handle at registration.
Requests lease a region; unregistering a leased region waits until the last
lease ends.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import os
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from framewire.client.errors import BadRequest, NotFound

from .sources import open_shm

if TYPE_CHECKING:
    from .cuda_source import CudaRuntime


@dataclass(eq=False)
class Region:
    name: str
    byte_size: int
    leases: int = field(default=0, init=False)
    idle: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def __post_init__(self) -> None:
        self.idle.set()

    def status(self) -> dict[str, object]:
        raise NotImplementedError

    def release(self) -> None:
        """Let go of what registration opened (no lease holds the region any more)."""


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

    def release(self) -> None:
        os.close(self.fd)


@dataclass(eq=False)
class CudaRegion(Region):
    device_id: int
    storage: Any  # a torch.UntypedStorage over the producer's allocation

    def status(self) -> dict[str, object]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}

    def release(self) -> None:
        self.storage = None


class RegionRegistry:
    def __init__(self, shm_prefixes: list[str], cuda: CudaRuntime | None = None):
        self.prefixes = shm_prefixes
        self.cuda = cuda
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()  # registration runs on request threads

    def _check_new(self, name: str) -> None:
        if name in self._regions:
            raise BadRequest(
                f"shared memory region '{name}' already in manager", code="region_exists"
            )

    def _add(self, region: Region) -> None:
        with self._lock:
            try:
                self._check_new(region.name)  # again: another request may have won meanwhile
            except BadRequest:
                region.release()
                raise
            self._regions[region.name] = region

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """A system region: ``byte_size`` bytes at ``offset`` of shm segment ``key``."""
        self._check_new(name)
        if offset < 0 or byte_size <= 0:
            raise BadRequest("offset must be >= 0 and byte_size > 0", code="bad_region")
        fd = open_shm(key, self.prefixes)
        size = os.fstat(fd).st_size
        if offset + byte_size > size:
            os.close(fd)
            raise BadRequest(
                f"region '{name}' ({offset}+{byte_size}) exceeds segment {key} of {size} bytes",
                code="region_out_of_bounds",
            )
        self._add(SystemRegion(name, byte_size, key, offset, fd))

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
    async def lease(self, name: str, offset: int, byte_size: int) -> AsyncIterator[Region]:
        """Hold region ``name`` while ``byte_size`` bytes at ``offset`` of it are in use."""
        region = self.get(name)
        if offset + byte_size > region.byte_size:
            raise BadRequest(
                f"offset {offset} + byte_size {byte_size} exceeds region '{name}' "
                f"of {region.byte_size} bytes",
                code="region_out_of_bounds",
            )
        region.leases += 1
        region.idle.clear()
        try:
            yield region
        finally:
            region.leases -= 1
            if region.leases == 0:
                region.idle.set()

    async def unregister(self, name: str | None = None, kind: type[Region] = SystemRegion) -> None:
        """Remove one region (or all) of ``kind``; unknown names are not an error, as in Triton."""
        names = list(self._regions) if name is None else [name]
        for n in names:
            region = self._regions.get(n)
            if region is None or not isinstance(region, kind):
                continue
            await region.idle.wait()
            if self._regions.pop(n, None) is region:
                region.release()

    async def close(self) -> None:
        await self.unregister(kind=Region)
