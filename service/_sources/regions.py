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

A region belongs to whoever registered it (docs/SECURITY.md): only that uid
(or an admin: root, the worker's uid) may use it or see it in the status; an
HTTP region is unregistered by its owner or an admin, an fd region only by
its connection. Each owner holds at most ``max_per_owner`` regions, so one
user cannot take every slot.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import mmap
import os
import re
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from framewire.core.errors import BadRequest, Forbidden, NotFound, Unavailable
from framewire.core.wire import REGION_NAME
from framewire.service._access.peers import READ, TRUSTED, Access
from framewire.service._sources.shm import judge_fd, open_shm


class CudaOpener(Protocol):
    """What maps a CUDA region's memory (the worker's CUDA runtime, when it has a GPU)."""

    def open_region(
        self, handle: bytes, device_id: int, byte_size: int, device_uuid: str | None = None
    ) -> Any: ...


@dataclass(eq=False)
class Region:
    name: str
    byte_size: int
    leases: int = field(default=0, init=False)
    removed: bool = field(default=False, init=False)  # unregistered; released at the last lease
    # The registrant's uid; None: an unidentified token holder, judged as the worker.
    owner: int | None = field(default=None, kw_only=True)

    def status(self) -> dict[str, object]:
        raise NotImplementedError

    def check(self, access: Access) -> None:
        """Raise unless the caller may read what the region maps: it must own the region
        (a name alone gives nobody another's frames)."""
        access.check_owner(self.owner, f"region '{self.name}'")

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
        super().check(access)
        access.check(os.fstat(self.fd), READ, f"region '{self.name}' (shm {self.key!r})")

    def release(self) -> None:
        os.close(self.fd)


@dataclass(eq=False)
class FdRegion(SystemRegion):
    """Bytes behind a descriptor a rank handed over; its frames are the rank's alone."""

    sealed: bool  # F_SEAL_SHRINK: mapped, converted straight from the mapping
    mapping: mmap.mmap | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.sealed:
            self.mapping = mmap.mmap(
                self.fd, self.offset + self.byte_size, mmap.MAP_SHARED, mmap.PROT_READ
            )

    def check(self, access: Access) -> None:
        Region.check(self, access)  # memory handed over: no mode bits to judge

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
        max_per_owner: int | None = None,
    ):
        self.prefixes = shm_prefixes
        self.cuda = cuda
        # Each system region holds a file descriptor for as long as it is registered.
        self.max_regions = max_regions
        self.max_per_owner = max_regions if max_per_owner is None else max_per_owner
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()  # registration runs on request threads

    def _check_new(self, name: str, owner: int | None) -> None:
        """Before anything is opened: a name the registry takes, free, with room left."""
        check_name(name)
        if name in self._regions:
            raise BadRequest(
                f"shared memory region '{name}' already in manager", code="region_exists"
            )
        if len(self._regions) >= self.max_regions:
            raise Unavailable(
                f"{len(self._regions)} regions are registered (FRAMEWIRE_MAX_REGIONS): "
                "unregister some first",
                code="too_many_regions",
            )
        held = sum(1 for r in list(self._regions.values()) if r.owner == owner)
        if held >= self.max_per_owner:
            who = "the worker" if owner is None else f"uid {owner}"
            raise Unavailable(
                f"{who} holds {held} regions (FRAMEWIRE_MAX_REGIONS_PER_OWNER): "
                "unregister some first",
                code="region_quota",
            )

    def _add(self, region: Region) -> None:
        with self._lock:
            try:
                # Again: another request may have won the name or the room meanwhile.
                self._check_new(region.name, region.owner)
            except BaseException:
                region.release()
                raise
            self._regions[region.name] = region

    def register(
        self, name: str, key: str, offset: int, byte_size: int, access: Access = TRUSTED
    ) -> None:
        """A system region: ``byte_size`` bytes at ``offset`` of shm segment ``key``."""
        owner = access.owner(f"region '{name}'")
        self._check_new(name, owner)
        if offset < 0 or byte_size <= 0:
            raise BadRequest("offset must be >= 0 and byte_size > 0", code="bad_region")
        fd = open_shm(key, self.prefixes)
        region = SystemRegion(name, byte_size, key, offset, fd, owner=owner)
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

    def register_fd(self, name: str, fd: int, offset: int, byte_size: int, owner: int) -> FdRegion:
        """An fd region over ``fd`` (taken over: closed with the region, or now on failure),
        handed over by uid ``owner``."""
        try:
            self._check_new(name, owner)
            sealed = judge_fd(fd, offset, byte_size)
            region = FdRegion(name, byte_size, f"fd:{name}", offset, fd, sealed, owner=owner)
        except BaseException:
            os.close(fd)
            raise
        self._add(region)
        return region

    def register_cuda(
        self,
        name: str,
        raw_handle: str,
        device_id: int,
        byte_size: int,
        access: Access = TRUSTED,
        device_uuid: str | None = None,
    ) -> None:
        """A CUDA region: the first ``byte_size`` bytes behind a base64 cudaIpcMemHandle_t,
        on the GPU ``device_uuid`` names when given, else the client's ``device_id``."""
        owner = access.owner(f"region '{name}'")
        if self.cuda is None:
            raise BadRequest(
                "this worker has no CUDA device: CUDA regions cannot be registered",
                code="cuda_unavailable",
            )
        self._check_new(name, owner)
        if byte_size <= 0 or device_id < 0:
            raise BadRequest("device_id must be >= 0 and byte_size > 0", code="bad_region")
        try:
            handle = base64.b64decode(raw_handle, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest("raw_handle.b64 is not base64", code="bad_cuda_handle") from None
        if not handle:
            raise BadRequest("raw_handle.b64 is empty", code="bad_cuda_handle")
        storage = self.cuda.open_region(handle, device_id, byte_size, device_uuid)
        self._add(CudaRegion(name, byte_size, device_id, storage, owner=owner))

    def get(self, name: str, kind: type[Region] = Region) -> Region:
        region = self._regions.get(name)
        if region is None or not isinstance(region, kind):
            raise NotFound(
                f"unable to find shared memory region: '{name}'", code="region_not_found"
            )
        return region

    def status(
        self, name: str | None = None, kind: type[Region] = SystemRegion, access: Access = TRUSTED
    ) -> list[dict[str, object]]:
        """The regions of ``kind`` the caller owns (an admin: all); another's is not found."""
        with self._lock:  # registrations on request threads change the dict meanwhile
            regions = [r for r in self._regions.values() if isinstance(r, kind)]
        if name is not None:
            region = self.get(name, kind)
            if not access.owns(region.owner):  # the answer for a name nobody took
                raise NotFound(
                    f"unable to find shared memory region: '{name}'", code="region_not_found"
                )
            return [region.status()]
        if not access.admin:  # once per listing, not once per region
            regions = [r for r in regions if access.owns(r.owner)]
        return [r.status() for r in regions]

    @contextlib.asynccontextmanager
    async def lease(
        self, name: str, offset: int, byte_size: int, access: Access = TRUSTED
    ) -> AsyncIterator[Region]:
        """Hold region ``name`` while ``byte_size`` bytes at ``offset`` of it are in use."""
        region = self.get(name)
        region.check(access)  # first: another's region tells nothing, not even its size
        if offset + byte_size > region.byte_size:
            raise BadRequest(
                f"offset {offset} + byte_size {byte_size} exceeds region '{name}' "
                f"of {region.byte_size} bytes",
                code="region_out_of_bounds",
            )
        region.leases += 1
        try:
            yield region
        finally:
            region.leases -= 1
            if region.leases == 0 and region.removed:
                region.release()

    def unregister(
        self, name: str | None = None, kind: type[Region] = SystemRegion, access: Access = TRUSTED
    ) -> None:
        """Remove region ``name`` of ``kind``, or all the caller may remove, at once; unknown
        names are not an error, as in Triton. A region in use is released when its last
        lease ends. fd regions are their connection's to unregister: never removed here."""
        with self._lock:
            if name is None:
                for region in list(self._regions.values()):
                    if isinstance(region, kind) and _removable(region, access):
                        self._remove(region)
                return
            named = self._regions.get(name)
            if named is None or not isinstance(named, kind):
                return
            if isinstance(named, FdRegion):
                raise Forbidden(
                    f"region '{name}' was registered on the fd socket: only that connection "
                    "unregisters it (or closes)",
                    code="caller_not_permitted",
                )
            access.check_owner(named.owner, f"region '{name}'")
            self._remove(named)

    def drop(self, region: Region) -> None:
        """Remove ``region`` itself, as :meth:`unregister` does, if it is still registered.

        Its registrant holds the object, not the name: once the HTTP endpoints have
        unregistered it, the name may already be another registrant's region."""
        with self._lock:
            if self._regions.get(region.name) is region:
                self._remove(region)

    def _remove(self, region: Region) -> None:
        del self._regions[region.name]
        region.retire()

    def close(self) -> None:
        with self._lock:
            for region in list(self._regions.values()):
                self._remove(region)


_NAME = re.compile(REGION_NAME)


def check_name(name: str) -> None:
    """The one rule for a region's name, on HTTP and the fd socket alike."""
    if _NAME.fullmatch(name) is None:
        shown = name[:64] + ("..." if len(name) > 64 else "")
        raise BadRequest(
            f"region name {shown!r}: 1 to 128 letters, digits or . _ : -, "
            "starting with a letter or digit",
            code="bad_region_name",
        )


def _removable(region: Region, access: Access) -> bool:
    return not isinstance(region, FdRegion) and access.owns(region.owner)
