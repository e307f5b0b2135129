"""CUDA frames: tensors of other processes opened from IPC handles, converted on their GPU.

Devices are matched by UUID (indices differ between processes). A handle is
opened with torch's own IPC machinery with two departures. The producer's IPC
reference counter is never touched: the producer releases it once the worker
has answered, so a request refused before the open strands no GPU memory, and
the worker never writes into a shared-memory file that a request names. The
producer's event, when it sent one, is opened as a torch Event that is
destroyed with the source instead of leaking one per request.

Conversion runs on a stream of the encode's own, one chunk at a time, with the
reference formula in the tensor's dtype: ``(x * 255).clamp(0, 255)``, then the
truncating cast to uint8 and the permute to (t, H, W, 3) in one copy
(``.to(torch.uint8)`` runs that same copy kernel). Each chunk then goes from
device to host straight into the staging slot that sendfile reads, page-locked
when the driver allows it. GPU temporaries: one chunk of scaled values and one
of uint8, nothing that grows with the clip.

Every CUDA call is made only where a GPU was found: without one this module
imports and does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from framewire.client.errors import BadRequest, Forbidden, FramewireError, NotFound
from framewire.client.wire import (
    IPC_HANDLE_BYTES,
    CudaIpcSource,
    DType,
    Layout,
    RegionSource,
    contiguous_strides,
    normalize_uuid,
)

from .convert import TORCH_DTYPES, slice_frames, to_thwc
from .sources import FrameSource, tensor_geometry
from .stream import ChunkWriter, Staging

if TYPE_CHECKING:
    from .regions import CudaRegion

log = logging.getLogger("framewire.cuda")

# Passed where torch wants the producer's ref-counter file: shm_open refuses a name
# with an inner slash, so the release torch attempts when the storage dies is a no-op.
NO_REF_COUNTER = b"/framewire-none/none"
CUDA_ERROR_NOT_FOUND = 500
TORCH_MALLOC_HANDLE = b"c"  # the type byte of torch's handles to plain cudaMalloc memory
TORCH_EXPANDABLE_HANDLE = b"e"  # ... and to its expandable segments (cuMemCreate memory)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


# ----------------------------------------------------------------------------- the source


class CudaTensorSource(FrameSource):
    """A CUDA tensor, read where it lies. ``event``: producer work to wait for first."""

    def __init__(
        self,
        tensor: torch.Tensor,
        layout: Layout | str = Layout.CTHW,
        *,
        event: torch.cuda.Event | None = None,
    ):
        if tensor.device.type != "cuda":
            raise BadRequest("CudaTensorSource takes CUDA tensors", code="bad_device")
        self.geometry = tensor_geometry(tensor, layout)
        self.tensor: torch.Tensor | None = tensor
        self.device = tensor.device
        self.gpu_index = tensor.device.index or 0
        self.event = event
        # Already rgb24 bytes in order: copied to the host as they are, no temporaries.
        self.as_is = (
            tensor.dtype == torch.uint8
            and self.geometry.layout is Layout.THWC
            and tensor.is_contiguous()
        )

    def frames(self) -> torch.Tensor:
        if self.tensor is None:
            raise RuntimeError("the CUDA source is closed")
        return self.tensor

    def read(
        self, t0: int, t1: int, r0: int = 0, r1: int | None = None
    ) -> tuple[torch.Tensor, bool]:
        """A host copy (the caller may scale it in place)."""
        g = self.geometry
        x = slice_frames(self.frames(), g.layout, t0, t1)
        if not (r0 == 0 and r1 in (None, g.height)):
            x = x[:, :, r0:r1] if g.layout is not Layout.THWC else x[:, r0:r1]
        with torch.cuda.device(self.device):
            if self.event is not None:
                torch.cuda.current_stream().wait_event(self.event)
            return x.to("cpu"), True

    def chunk_writer(self) -> CudaWriter:
        return CudaWriter(self)

    def gpu_bytes(self, frames_per_chunk: int) -> int:
        g = self.geometry
        samples = 3 * g.height * g.width * frames_per_chunk
        if self.as_is:
            return 0
        if g.dtype is DType.uint8:
            return samples  # the interleaved copy
        return samples * (g.dtype.itemsize + 1)  # the scaled values and the interleaved cast

    def close(self) -> None:
        self.tensor = None
        self.event = None


class CudaWriter(ChunkWriter):
    """Converts chunks on the source's GPU and copies each into host staging."""

    def __init__(self, source: CudaTensorSource):
        self.source = source
        self.stream: torch.cuda.Stream | None = None
        self.scaled: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        self._pinned_at: int | None = None

    def open(self, staging: Staging | None, frames: int) -> None:
        src, g = self.source, self.source.geometry
        samples = 3 * frames * g.height * g.width
        with torch.cuda.device(src.device):
            self.stream = torch.cuda.Stream(src.device)
            if src.event is not None:
                self.stream.wait_event(src.event)
            # Allocated on the default stream and used on ours, freed only after ours is
            # synchronized (close): every encode draws from the one cache pool.
            if g.dtype is not DType.uint8:
                self.scaled = torch.empty(samples, dtype=src.frames().dtype, device=src.device)
            if not src.as_is:
                self.packed = torch.empty(samples, dtype=torch.uint8, device=src.device)
            # Only a pipe reader's consumption can be tracked (see stream.PipeDrain).
            if staging is not None and staging.in_flight is not None:
                address = staging.address()
                if pin_host(address, staging.size, src.device):
                    self._pinned_at = address
                    self.pinned = True

    def write(self, take: Callable[[], torch.Tensor], t0: int, t1: int) -> None:
        src, g = self.source, self.source.geometry
        assert self.stream is not None, "open() first"
        with torch.cuda.device(src.device), torch.cuda.stream(self.stream):
            x = slice_frames(src.frames(), g.layout, t0, t1)
            if self.scaled is not None:
                scaled = self.scaled[: x.numel()].view(x.shape)
                torch.mul(x, 255, out=scaled)
                scaled.clamp_(0, 255)
                x = scaled
            frames = to_thwc(x, g.layout)
            if self.packed is not None:
                packed = self.packed[: frames.numel()].view(frames.shape)
                packed.copy_(frames)
                frames = packed
            # Asked for only now: the kernels above run while the slot drains.
            out = take().view(t1 - t0, g.height, g.width, 3)
            try:
                out.copy_(frames)  # on our stream, and waited for
            finally:
                del out

    def close(self) -> None:
        if self.stream is not None:
            # Nothing of ours may still read the producer's memory or write the staging.
            self.stream.synchronize()
        if self._pinned_at is not None:
            unpin_host(self._pinned_at, self.source.device)
            self._pinned_at = None
        self.scaled = self.packed = None


# ----------------------------------------------------------------------------- pinning


def _cuda_status(err: object) -> int:
    return int(getattr(err, "value", err))  # type: ignore[call-overload]


def _clear_last_error(device: torch.device) -> None:
    """Consume the runtime's sticky "last error" of this thread after a failed call.

    torch reads it after its next kernel launch here and would blame that kernel;
    a throwaway launch takes the blame instead.
    """
    with contextlib.suppress(RuntimeError):
        torch.zeros(1, device=device)


def pin_host(address: int, size: int, device: torch.device) -> bool:
    """Page-lock ``size`` bytes at ``address`` for DMA; False (nothing pinned) if refused."""
    with torch.cuda.device(device):
        err = torch.cuda.cudart().cudaHostRegister(address, size, 0)
        if _cuda_status(err) == 0:
            return True
        _clear_last_error(device)
    log.info("staging could not be page-locked (cuda error %s): unpinned copies", err)
    return False


def unpin_host(address: int, device: torch.device) -> None:
    with torch.cuda.device(device):
        if _cuda_status(torch.cuda.cudart().cudaHostUnregister(address)) != 0:
            _clear_last_error(device)


# ----------------------------------------------------------------------------- handles


@functools.cache
def _address_range_fn() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    ]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def _allocation_of(pointer: int) -> tuple[int, int] | None:
    """(base, size) of the device allocation holding ``pointer``; None when unknown."""
    fn = _address_range_fn()
    if fn is None:
        return None
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if fn(ctypes.byref(base), ctypes.byref(size), pointer) != 0:
        return None
    return base.value, size.value


def check_allocation(storage: torch.UntypedStorage, handle: bytes, nbytes: int) -> None:
    """Refuse a storage that runs past the end of the allocation it starts in.

    Reading past it would be an illegal address, which leaves the worker's CUDA
    context unusable for good. Asked of the driver only for plain cudaMalloc
    handles (CUDA's own 64 bytes, or torch's with its version and type bytes):
    for torch's expandable segments the driver describes one mapped piece only.
    """
    plain = len(handle) == IPC_HANDLE_BYTES or (
        len(handle) == IPC_HANDLE_BYTES + 2 and handle[1:2] == TORCH_MALLOC_HANDLE
    )
    if not plain:
        return
    start = storage.data_ptr()
    found = _allocation_of(start)
    if found is None:
        return
    base, size = found
    if start + nbytes > base + size:
        raise BadRequest(
            f"the storage claims {nbytes} bytes at offset {start - base} of an allocation "
            f"of {size} bytes",
            code="cuda_tensor_out_of_bounds",
        )


def open_storage(device: int, handle: bytes, size: int, offset: int = 0) -> torch.UntypedStorage:
    """Map ``size`` bytes at ``offset`` of another process's allocation on ``device``."""
    with torch.cuda.device(device):
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                device, handle, size, offset, NO_REF_COUNTER, 0, b"", False
            )
        except RuntimeError as exc:
            raise open_error(handle, exc) from None
        check_allocation(storage, handle, size)
    return storage


def open_error(handle: bytes, exc: RuntimeError) -> FramewireError:
    """What a handle that torch could not open is answered with.

    Expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` in the
    producer) are shared as file descriptors that the importer takes out of the
    producer with ``pidfd_open``/``pidfd_getfd``. That needs the producer's PID
    namespace and ptrace rights over it, which a default container or Yama's
    ptrace_scope 1 denies: a deployment matter, answered as one.
    """
    why, text = _first_line(exc), str(exc)
    if handle[1:2] == TORCH_EXPANDABLE_HANDLE and "pidfd" in text:
        if "not permitted" in text:
            return Forbidden(
                "the tensor lies in a torch expandable segment, whose memory the worker "
                "must take from the producer process with pidfd_getfd, and it may not: "
                "give the worker CAP_SYS_PTRACE (and the producer's PID namespace), or "
                f"allocate the video outside expandable segments: {why}",
                code="cuda_ipc_not_permitted",
            )
        return BadRequest(
            "the tensor lies in a torch expandable segment, and its producer process is "
            "not visible to the worker (it exited, or runs in another PID namespace: "
            f"share the worker's): {why}",
            code="cuda_handle_invalid",
        )
    return BadRequest(
        "cannot open the CUDA IPC handle (freed, from another host or container, "
        f"or not for this GPU): {why}",
        code="cuda_handle_invalid",
    )


def tensor_on(
    storage: torch.UntypedStorage,
    dtype: DType,
    offset: int,
    shape: list[int],
    strides: list[int],
) -> torch.Tensor:
    """A tensor viewing ``storage`` (``offset`` in elements), never reaching past it."""
    last = offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    need = (last + 1) * dtype.itemsize
    if min(strides) < 0 or need > storage.nbytes():
        raise BadRequest(
            f"shape {shape}, stride {strides} and offset {offset} of {dtype} reach byte "
            f"{need} of a storage of {storage.nbytes()}",
            code="cuda_tensor_out_of_bounds",
        )
    empty = torch.empty(0, dtype=TORCH_DTYPES[dtype], device=storage.device)
    try:
        return empty.set_(storage, offset, shape, strides)
    except RuntimeError as exc:
        raise BadRequest(_first_line(exc), code="cuda_tensor_out_of_bounds") from None


# ----------------------------------------------------------------------------- the runtime


class CudaRuntime:
    """The worker's GPUs, found and warmed once at start, matched by UUID."""

    def __init__(self) -> None:
        torch.cuda.init()
        self.devices: dict[str, int] = {
            normalize_uuid(torch.cuda.get_device_properties(i).uuid): i
            for i in range(torch.cuda.device_count())
        }

    @classmethod
    def start(cls) -> CudaRuntime | None:
        """The runtime, warmed up, or None without a usable GPU."""
        if not cuda_available():
            return None
        try:
            runtime = cls()
            runtime.warm()
        except RuntimeError as exc:
            # Host encodes do not need the GPU: serve them, and refuse CUDA sources.
            log.warning("CUDA is present but unusable, serving without it: %s", exc)
            return None
        for uuid, index in sorted(runtime.devices.items(), key=lambda kv: kv[1]):
            name = torch.cuda.get_device_name(index)
            log.info("CUDA device cuda:%d %s (GPU-%s) ready", index, name, uuid)
        return runtime

    def warm(self) -> None:
        """Create each device's context and load the conversion kernels now, so the first
        request pays for neither; then forget the warm-up in the peak-memory figures."""
        for index in self.devices.values():
            with torch.cuda.device(index):
                for dtype in TORCH_DTYPES.values():
                    x = torch.zeros((3, 2, 8, 8), dtype=dtype, device=index)
                    out = torch.empty((2, 8, 8, 3), dtype=torch.uint8)
                    writer = CudaWriter(CudaTensorSource(x))
                    writer.open(None, 2)
                    try:
                        writer.write(lambda out=out: out, 0, 2)
                    finally:
                        writer.close()
                torch.cuda.synchronize(index)
                torch.cuda.reset_peak_memory_stats(index)

    def device_index(self, uuid: str) -> int:
        try:
            return self.devices[normalize_uuid(uuid)]
        except (KeyError, ValueError):
            seen = ", ".join(sorted(self.devices)) or "none"
            raise NotFound(
                f"no GPU with UUID {uuid} is visible to the worker (it sees: {seen})",
                code="cuda_device_not_found",
            ) from None

    def open_ipc(self, src: CudaIpcSource) -> CudaTensorSource:
        """The producer's tensor, mapped on the same GPU here."""
        index = self.device_index(src.device_uuid)
        event = None
        event_handle = src.event_bytes
        if event_handle is not None:
            try:
                with torch.cuda.device(index):
                    event = torch.cuda.Event.from_ipc_handle(
                        torch.device("cuda", index), event_handle
                    )
            except RuntimeError as exc:
                raise BadRequest(
                    f"cannot open the producer's CUDA event: {_first_line(exc)}",
                    code="cuda_handle_invalid",
                ) from None
        storage = open_storage(
            index, src.handle_bytes, src.storage_size_bytes, src.storage_offset_bytes
        )
        tensor = tensor_on(storage, src.dtype, src.tensor_offset, src.shape, src.strides)
        return CudaTensorSource(tensor, src.layout, event=event)

    def open_region(self, handle: bytes, device_id: int, byte_size: int) -> torch.UntypedStorage:
        """A Triton-style CUDA region: ``byte_size`` bytes from the start of the allocation."""
        if not 0 <= device_id < torch.cuda.device_count():
            raise NotFound(
                f"no CUDA device {device_id} (the worker sees {torch.cuda.device_count()})",
                code="cuda_device_not_found",
            )
        return open_storage(device_id, handle, byte_size)

    def region_source(self, region: CudaRegion, src: RegionSource) -> CudaTensorSource:
        itemsize = src.dtype.itemsize
        if src.offset % itemsize:
            raise BadRequest(
                f"offset {src.offset} is not a multiple of the {src.dtype} size {itemsize}",
                code="bad_offset",
            )
        strides = contiguous_strides(src.shape)
        tensor = tensor_on(region.storage, src.dtype, src.offset // itemsize, src.shape, strides)
        return CudaTensorSource(tensor, src.layout)

    def free_bytes(self, index: int) -> int:
        """Free memory on device ``index``, counting blocks our cache holds unused."""
        driver_free, _ = torch.cuda.mem_get_info(index)
        cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
        return int(driver_free + cached)

    def gpu_budget(self, held: Callable[[int], int]) -> Callable[[int], int]:
        """What the scheduler may admit on a device: a quarter of its free memory plus
        what encodes already hold there (``held``)."""
        return lambda index: self.free_bytes(index) // 4 + held(index)

    def info(self) -> dict[str, object]:
        devices = []
        for uuid, index in sorted(self.devices.items(), key=lambda kv: kv[1]):
            props = torch.cuda.get_device_properties(index)
            devices.append(
                {
                    "index": index,
                    "name": props.name,
                    "uuid": uuid,
                    "total_bytes": props.total_memory,
                    "free_bytes": torch.cuda.mem_get_info(index)[0],
                    "memory_allocated": torch.cuda.memory_allocated(index),
                    "max_memory_allocated": torch.cuda.max_memory_allocated(index),
                }
            )
        return {"devices": devices}
