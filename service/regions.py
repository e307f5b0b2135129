"""The system shared-memory region registry, after NVIDIA Triton's extension.

A region is a named window (key, offset, byte_size) of a POSIX shm segment,
opened read-only once at registration. Requests lease it; unregistering a
region that is leased waits until the last lease ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from framewire.client.errors import BadRequest, NotFound

from .sources import open_shm


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    leases: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def status(self) -> dict[str, object]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }


class RegionRegistry:
    def __init__(self, shm_prefixes: list[str]):
        self.prefixes = shm_prefixes
        self._regions: dict[str, Region] = {}

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if name in self._regions:
            raise BadRequest(
                f"shared memory region '{name}' already in manager", code="region_exists"
            )
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
        region = Region(name, key, offset, byte_size, fd)
        region.idle.set()
        self._regions[name] = region

    def get(self, name: str) -> Region:
        try:
            return self._regions[name]
        except KeyError:
            raise NotFound(
                f"unable to find shared memory region: '{name}'", code="region_not_found"
            ) from None

    def status(self, name: str | None = None) -> list[dict[str, object]]:
        if name is not None:
            return [self.get(name).status()]
        return [r.status() for r in self._regions.values()]

    @contextlib.asynccontextmanager
    async def lease(self, name: str, offset: int, byte_size: int) -> AsyncIterator[tuple[int, int]]:
        """Hold region ``name`` and yield (its fd, the absolute offset); the fd stays ours."""
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
            yield region.fd, region.offset + offset
        finally:
            region.leases -= 1
            if region.leases == 0:
                region.idle.set()

    async def unregister(self, name: str | None = None) -> None:
        """Remove one region (or all); unknown names are not an error, as in Triton."""
        names = list(self._regions) if name is None else [name]
        for n in names:
            region = self._regions.get(n)
            if region is None:
                continue
            await region.idle.wait()
            if self._regions.pop(n, None) is region:
                os.close(region.fd)

    async def close(self) -> None:
        await self.unregister()
