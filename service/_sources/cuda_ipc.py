"""CUDA tensors of other processes, opened from their IPC handles, and the worker's GPUs.

Devices are matched by UUID (indices differ between processes). A handle is
opened with torch's own IPC machinery with two departures. The producer's IPC
reference counter is never touched: the producer releases it once the worker
has answered, so a request refused before the open strands no GPU memory, and
the worker never writes into a shared-memory file that a request names. The
producer's event, when it sent one, is opened as a torch Event that is
destroyed with the source instead of leaking one per request.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable

import torch
from framewire.core.errors import BadRequest, Forbidden, FramewireError, NotFound
from framewire.core.wire import (
    IPC_HANDLE_BYTES,
    CudaIpcSource,
    DType,
    Layout,
    RegionSource,
    contiguous_strides,
    normalize_uuid,
)
from framewire.service._convert.convert import TORCH_DTYPES
from framewire.service._sources.cuda_convert import (
    CudaTensorSource,
    CudaWriter,
    cuda_available,
    first_line,
)
from framewire.service._sources.cuda_faults import HEALTH, classified
from framewire.service._sources.cuda_handles import HandleLocks
from framewire.service._sources.regions import CudaRegion

log = logging.getLogger("framewire.cuda")

# Passed where torch wants the producer's ref-counter file: shm_open refuses a name
# with an inner slash, so the release torch attempts when the storage dies is a no-op.
NO_REF_COUNTER = b"/framewire-none/none"
CUDA_ERROR_NOT_FOUND = 500
TORCH_MALLOC_HANDLE = b"c"  # the type byte of torch's handles to plain cudaMalloc memory
TORCH_EXPANDABLE_HANDLE = b"e"  # ... and to its expandable segments (cuMemCreate memory)


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
    return fn


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
    why, text = first_line(exc), str(exc)
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
        raise BadRequest(first_line(exc), code="cuda_tensor_out_of_bounds") from None


# ----------------------------------------------------------------------------- the runtime


class IpcTensorSource(CudaTensorSource):
    """A producer's tensor opened from its IPC handle: let go of under the handle's lock
    (service/_sources/cuda_handles.py)."""

    def __init__(
        self,
        tensor: torch.Tensor,
        layout: Layout | str,
        *,
        event: torch.cuda.Event | None,
        handle: tuple[HandleLocks, bytes],
    ):
        super().__init__(tensor, layout, event=event)
        self._handle: tuple[HandleLocks, bytes] | None = handle

    def close(self) -> None:
        held, self._handle = self._handle, None
        if held is None:
            return
        locks, handle = held
        locks.close(handle, super().close)


def _make_context(index: int) -> None:
    """Device ``index``'s context, and each dtype's conversion run once on it."""
    with torch.cuda.device(index):
        for dtype in TORCH_DTYPES.values():
            x = torch.zeros((3, 2, 8, 8), dtype=dtype, device=index)
            out = torch.empty((2, 8, 8, 3), dtype=torch.uint8)
            writer = CudaWriter(CudaTensorSource(x))
            writer.open(None, 2)
            try:
                writer.write(functools.partial(lambda t: t, out), 0, 2)
            finally:
                writer.close()
        torch.cuda.synchronize(index)
        torch.cuda.reset_peak_memory_stats(index)


class CudaRuntime:
    """The worker's GPUs, found once at start and matched by UUID. A GPU's context and
    conversion kernels are made at start (``warm="start"``) or on the first request
    that names it (``"first-use"``): a GPU no request names then costs nothing."""

    handles: HandleLocks  # the IPC handles open now, each opened and let go one step at a time

    def __init__(self, devices: dict[str, int] | None = None) -> None:
        if devices is None:
            torch.cuda.init()  # counts the devices; makes no context
            devices = {
                normalize_uuid(torch.cuda.get_device_properties(i).uuid): i
                for i in range(torch.cuda.device_count())
            }
        self.devices = devices
        self.handles = HandleLocks()
        self.warmed: set[int] = set()
        # One lock per GPU: first requests to two GPUs make their contexts side by side.
        self._warming = {index: threading.Lock() for index in devices.values()}

    @classmethod
    def start(cls, warm: str = "start") -> CudaRuntime | None:
        """The runtime (every GPU warmed, with ``warm="start"``), or None without a usable
        GPU."""
        if not cuda_available():
            return None
        try:
            runtime = cls()
            if warm == "start":
                for index in runtime.devices.values():
                    runtime.warm(index)
        except (RuntimeError, FramewireError) as exc:
            # Host encodes do not need the GPU: serve them, and refuse CUDA sources.
            log.warning("CUDA is present but unusable, serving without it: %s", exc)
            return None
        state = "ready" if warm == "start" else "found (its context is made on first use)"
        for uuid, index in sorted(runtime.devices.items(), key=lambda kv: kv[1]):
            name = torch.cuda.get_device_name(index)
            log.info("CUDA device cuda:%d %s (GPU-%s) %s", index, name, uuid, state)
        return runtime

    def warm(self, index: int) -> None:
        """Create device ``index``'s context and load the conversion kernels, once, so no
        encode's window pays for them; then forget the warm-up in the peak-memory figures.
        A CUDA error here is classified as any other (a full GPU: gpu_out_of_memory)."""
        with self._warming[index]:
            if index in self.warmed:
                return
            with classified(index):
                _make_context(index)
            self.warmed.add(index)
            log.info("CUDA device cuda:%d warmed (its context made)", index)

    def _usable(self, index: int) -> None:
        HEALTH.check(index)  # a context a sticky error poisoned is not touched again
        self.warm(index)

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
        self._usable(index)
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
                    f"cannot open the producer's CUDA event: {first_line(exc)}",
                    code="cuda_handle_invalid",
                ) from None
        handle = src.handle_bytes

        def opened() -> IpcTensorSource:
            storage = open_storage(index, handle, src.storage_size_bytes, src.storage_offset_bytes)
            tensor = tensor_on(storage, src.dtype, src.tensor_offset, src.shape, src.strides)
            return IpcTensorSource(tensor, src.layout, event=event, handle=(self.handles, handle))

        return self.handles.open(handle, opened)

    def open_region(
        self, handle: bytes, device_id: int, byte_size: int, device_uuid: str | None = None
    ) -> torch.UntypedStorage:
        """A Triton-style CUDA region: ``byte_size`` bytes from the start of the allocation.
        Triton's ``device_id`` is the client's index, the same GPU here only where both
        see the same CUDA_VISIBLE_DEVICES; ``device_uuid`` (framewire's) names it anywhere."""
        if device_uuid is not None:
            device_id = self.device_index(device_uuid)
        if not 0 <= device_id < torch.cuda.device_count():
            raise NotFound(
                f"no CUDA device {device_id} (the worker sees {torch.cuda.device_count()})",
                code="cuda_device_not_found",
            )
        self._usable(device_id)
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
        """Each GPU; its memory figures only once warmed (asking a cold one for them would
        make its context)."""
        devices = []
        for uuid, index in sorted(self.devices.items(), key=lambda kv: kv[1]):
            props = torch.cuda.get_device_properties(index)
            entry: dict[str, object] = {
                "index": index,
                "name": props.name,
                "uuid": uuid,
                "total_bytes": props.total_memory,
                "context": index in self.warmed,
            }
            if index in self.warmed:
                entry |= {
                    "free_bytes": torch.cuda.mem_get_info(index)[0],
                    "memory_allocated": torch.cuda.memory_allocated(index),
                    "max_memory_allocated": torch.cuda.max_memory_allocated(index),
                }
            devices.append(entry)
        return {"devices": devices}
