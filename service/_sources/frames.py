"""Where frames come from: an in-process tensor, or bytes behind a file descriptor.

A source hands out chunks over T in its own layout. File-backed sources (POSIX
shared memory, an .npy file) are read with ``pread`` into a buffer the encoder
owns instead of being mapped: a client that truncates its segment mid-encode
then yields a short read, an error, instead of a SIGBUS that kills the worker.
Only memory that cannot shrink (a memfd sealed with ``F_SEAL_SHRINK``) is
mapped and converted where it lies (:class:`MappedSource`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from framewire.core.errors import BadRequest
from framewire.core.wire import DType, Layout
from framewire.service._convert.convert import TORCH_DTYPES, WIRE_DTYPES, slice_frames
from framewire.service._convert.staging import ChunkWriter


@dataclass
class Geometry:
    dtype: DType
    layout: Layout
    frames: int
    height: int
    width: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.layout.shape(self.frames, self.height, self.width)

    @property
    def nbytes(self) -> int:
        return 3 * self.frames * self.height * self.width * self.dtype.itemsize


def tensor_geometry(tensor: torch.Tensor, layout: Layout | str) -> Geometry:
    """The geometry of a clip tensor in ``layout``, or the 4xx that says why it is none."""
    if tensor.dtype not in WIRE_DTYPES:
        raise BadRequest(f"unsupported dtype {tensor.dtype}", code="bad_dtype")
    layout = Layout(layout)
    try:
        channels, frames, height, width = layout.dims(tuple(tensor.shape))
    except ValueError as exc:
        raise BadRequest(str(exc), code="bad_shape") from exc
    if channels != 3 or frames < 1:
        raise BadRequest(
            f"shape {list(tensor.shape)} is not a 3-channel clip in {layout}", code="bad_shape"
        )
    return Geometry(WIRE_DTYPES[tensor.dtype], layout, frames, height, width)


def byte_runs(
    g: Geometry, offset: int, t0: int, t1: int, r0: int, r1: int
) -> list[tuple[int, int]]:
    """(byte offset, length) of each contiguous run holding frames ``[t0, t1)``, rows
    ``[r0, r1)``, of a C-contiguous clip at ``offset``, in tensor order."""
    item = g.dtype.itemsize
    row = g.width * item  # one row of one plane (planar layouts) ...
    plane = g.height * row
    full = r0 == 0 and r1 == g.height
    if g.layout is Layout.THWC:
        frame = 3 * plane
        if full:
            return [(offset + t0 * frame, (t1 - t0) * frame)]
        return [(offset + t0 * frame + 3 * r0 * row, 3 * (r1 - r0) * row)]
    if g.layout is Layout.CTHW:
        channel = g.frames * plane
        if full:
            return [(offset + c * channel + t0 * plane, (t1 - t0) * plane) for c in range(3)]
        return [(offset + c * channel + t0 * plane + r0 * row, (r1 - r0) * row) for c in range(3)]
    frame = 3 * plane  # TCHW
    if full:
        return [(offset + t0 * frame, (t1 - t0) * frame)]
    return [(offset + t0 * frame + c * plane + r0 * row, (r1 - r0) * row) for c in range(3)]


class FrameSource:
    """What the encoder reads. Subclasses fill in ``read``."""

    geometry: Geometry
    gpu_index = 0  # the CUDA device that ``gpu_bytes`` are held on
    close_in_thread = False  # close() blocks (driver work holding the GIL): not on the loop

    def read(
        self, t0: int, t1: int, r0: int = 0, r1: int | None = None
    ) -> tuple[torch.Tensor, bool]:
        """Frames [t0, t1), rows [r0, r1), in the source layout, and whether the caller may
        scale them in place. A partial row range is asked for one frame at a time."""
        raise NotImplementedError

    def zero_copy(self) -> tuple[int, int] | None:
        """(fd, offset) of contiguous THWC uint8 bytes that can be sent as they are."""
        return None

    def read_into(self, t0: int, t1: int, out: torch.Tensor) -> bool:
        """Frames [t0, t1) copied into ``out`` (uint8 host memory of their bytes) as
        they are, where they are THWC uint8 in a file: False where this source cannot."""
        return False

    def chunk_writer(self) -> ChunkWriter | None:
        """A converter of its own (a GPU source converts where its frames are); None: the
        host converts what ``read`` returns."""
        return None

    def gpu_bytes(self, frames_per_chunk: int) -> int:
        """GPU memory its conversion holds at ``frames_per_chunk`` frames a chunk."""
        return 0

    def close(self) -> None:
        pass


class TensorSource(FrameSource):
    """A CPU torch tensor or numpy array, used where it lies (never copied whole)."""

    def __init__(self, data: torch.Tensor | np.ndarray, layout: Layout | str = Layout.CTHW):
        tensor = torch.from_numpy(np.asarray(data)) if isinstance(data, np.ndarray) else data
        if tensor.device.type != "cpu":
            raise BadRequest("TensorSource takes CPU tensors", code="bad_device")
        self.geometry = tensor_geometry(tensor, layout)
        self.tensor = tensor

    def read(
        self, t0: int, t1: int, r0: int = 0, r1: int | None = None
    ) -> tuple[torch.Tensor, bool]:
        x = slice_frames(self.tensor, self.geometry.layout, t0, t1)
        if r0 == 0 and r1 in (None, self.geometry.height):
            return x, False
        rows = slice(r0, r1)
        layout = self.geometry.layout
        return (x[:, :, rows] if layout is not Layout.THWC else x[:, rows]), False


def pread_rgb24(g: Geometry, fd: int, offset: int, t0: int, t1: int, out: torch.Tensor) -> bool:
    """``read_into`` for frames at ``offset`` of ``fd``: one ``pread``, the kernel copying
    from the file's pages (mapping them would fault each in, and drop it after)."""
    if rgb24_span(g, fd, offset) is None:
        return False
    frame = 3 * g.height * g.width
    want = (t1 - t0) * frame
    view = out.numpy().reshape(-1)[:want].data
    if pread_full(fd, view, offset + t0 * frame) < want:
        raise BadRequest(
            "the shared-memory segment shrank while it was being read", code="segment_truncated"
        )
    return True


def pread_full(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``fd`` at ``offset``; the bytes read (fewer only at end of file)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


class FileSource(FrameSource):
    """Bytes at ``offset`` of an open file (a shm segment, an .npy body), C-contiguous."""

    def __init__(self, fd: int, offset: int, geometry: Geometry, *, owns_fd: bool = True):
        self.fd = fd
        self.offset = offset
        self.geometry = geometry
        self.owns_fd = owns_fd
        self._buffer: torch.Tensor | None = None
        size = os.fstat(fd).st_size
        if offset + geometry.nbytes > size:
            raise BadRequest(
                f"the segment holds {size} bytes; the descriptor needs "
                f"{offset + geometry.nbytes} (offset {offset} + {geometry.nbytes})",
                code="segment_too_small",
            )

    def read(
        self, t0: int, t1: int, r0: int = 0, r1: int | None = None
    ) -> tuple[torch.Tensor, bool]:
        g = self.geometry
        r1 = g.height if r1 is None else r1
        shape = g.layout.shape(t1 - t0, r1 - r0, g.width)
        numel = 3 * (t1 - t0) * (r1 - r0) * g.width
        if self._buffer is None or self._buffer.numel() < numel:
            self._buffer = torch.empty(numel, dtype=TORCH_DTYPES[g.dtype])
        out = self._buffer[:numel]
        raw = out.view(torch.uint8).numpy()
        pos = 0
        for offset, length in byte_runs(g, self.offset, t0, t1, r0, r1):
            if pread_full(self.fd, raw[pos : pos + length].data, offset) < length:
                raise BadRequest(
                    "the shared-memory segment shrank while it was being read",
                    code="segment_truncated",
                )
            pos += length
        return out.view(shape), True

    def zero_copy(self) -> tuple[int, int] | None:
        return rgb24_span(self.geometry, self.fd, self.offset)

    def read_into(self, t0: int, t1: int, out: torch.Tensor) -> bool:
        return pread_rgb24(self.geometry, self.fd, self.offset, t0, t1, out)

    def close(self) -> None:
        self._buffer = None
        if self.owns_fd and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def rgb24_span(g: Geometry, fd: int, offset: int) -> tuple[int, int] | None:
    """Where frames that are rgb24 already lie in ``fd``: sent to ffmpeg as they are."""
    if g.dtype is DType.uint8 and g.layout is Layout.THWC:
        return fd, offset
    return None


FAULT_AROUND = 64 << 10  # Linux's fault_around_bytes default (and its usual setting)
DROP_BYTES = 32 << 20  # mapped pages read before they are dropped again


class MappedSource(FrameSource):
    """Frames at ``offset`` of a mapping that cannot shrink under us: read in place.

    The pages read are dropped from this process's page tables once DROP_BYTES of
    them have been (``MADV_DONTNEED`` on a shared mapping frees nothing but the
    mapping's own entries), so the worker's resident memory does not grow with
    the clip while the rank's pages stay as they are. In batches: each drop of a
    multi-threaded process's mappings costs a TLB shootdown, and per 1 MiB block
    they cost more than the faults they follow (benchmarks/routes.py).
    """

    def __init__(self, mapping: mmap.mmap, fd: int, offset: int, geometry: Geometry):
        self.mapping, self.fd, self.offset, self.geometry = mapping, fd, offset, geometry
        g = geometry
        with warnings.catch_warnings():  # "not writable": it is not written, by design
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(mapping, dtype=torch.uint8, count=g.nbytes, offset=offset)
        self._frames: torch.Tensor | None = flat.view(TORCH_DTYPES[g.dtype]).view(g.shape)
        self._base = flat.data_ptr() - offset  # the mapping's address: fd offset 0
        self._touched: list[tuple[int, int]] = []  # byte runs read and not dropped yet
        self._touched_bytes = 0
        self._holes: FileSource | None = None  # reads blocks with holes in them

    def read(
        self, t0: int, t1: int, r0: int = 0, r1: int | None = None
    ) -> tuple[torch.Tensor, bool]:
        assert self._frames is not None, "closed"
        g = self.geometry
        if self._touched_bytes >= DROP_BYTES:
            self._drop_touched()  # blocks before this one: converted already
        x = slice_frames(self._frames, g.layout, t0, t1)
        if not (r0 == 0 and r1 in (None, g.height)):
            x = x[:, :, r0:r1] if g.layout is not Layout.THWC else x[:, r0:r1]
        runs = byte_runs(g, self.offset, t0, t1, r0, g.height if r1 is None else r1)
        if _has_hole(self._base, runs):
            # A read fault on a hole of shared memory allocates the page: a never-written
            # memfd would be made real, page by page, by the worker. pread gives zeros.
            if self._holes is None:
                self._holes = FileSource(self.fd, self.offset, g, owns_fd=False)
            return self._holes.read(t0, t1, r0, r1)
        self._touched += runs
        self._touched_bytes += sum(length for _, length in runs)
        return x, False  # the rank's memory: never scaled in place

    def _drop_touched(self) -> None:
        for start, length in self._touched:
            # From FAULT_AROUND before it: a fault maps the pages around it that are in
            # memory, so reading this run mapped the tail of the run before it again.
            aligned = max(0, start - FAULT_AROUND) // mmap.PAGESIZE * mmap.PAGESIZE
            self.mapping.madvise(mmap.MADV_DONTNEED, aligned, start + length - aligned)
        self._touched, self._touched_bytes = [], 0

    def zero_copy(self) -> tuple[int, int] | None:
        return rgb24_span(self.geometry, self.fd, self.offset)

    def read_into(self, t0: int, t1: int, out: torch.Tensor) -> bool:
        # Holes read as zeros here too, and allocate nothing.
        return pread_rgb24(self.geometry, self.fd, self.offset, t0, t1, out)

    def close(self) -> None:
        if self._holes is not None:
            self._holes.close()
            self._holes = None
        if self._frames is not None:
            self._drop_touched()
            self._frames = None  # the region unmaps once no view is left


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)


def _has_hole(base: int, runs: list[tuple[int, int]]) -> bool:
    """Whether a run (at most three) of the mapping at ``base`` holds a page that is not in
    memory: a hole (never written) or a page swapped out, which ``pread`` reads as well.
    ``mincore`` looks at the run's own pages and touches none; ``SEEK_HOLE`` would scan
    on from the run to the first hole, the region's end when it has none: a scan of the
    whole region for every block (0.07 CPU-s of 0.15 for a 140 MB clip)."""
    page = mmap.PAGESIZE
    for start, length in runs:
        first = start // page * page
        pages = (start + length - first + page - 1) // page
        vec = ctypes.create_string_buffer(pages)
        if _libc.mincore(base + first, pages * page, vec) != 0:
            return True  # not known: pread is right either way
        if not (np.frombuffer(vec.raw, np.uint8) & 1).all():
            return True
    return False


def open_npy(path: str | os.PathLike[str], layout: Layout | str = Layout.CTHW) -> FileSource:
    """An .npy file as a FileSource: the header is parsed, the body is read in chunks."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        readers = {
            (1, 0): np.lib.format.read_array_header_1_0,
            (2, 0): np.lib.format.read_array_header_2_0,
        }
        if version not in readers:
            raise BadRequest(f"{path}: .npy format {version} is not supported", code="bad_npy")
        shape, fortran, dtype = readers[version](f)
        offset = f.tell()
    if fortran:
        raise BadRequest(f"{path}: Fortran-ordered arrays are not supported", code="bad_layout")
    try:
        wire = DType(str(dtype))
    except ValueError as exc:
        raise BadRequest(f"{path}: unsupported dtype {dtype}", code="bad_dtype") from exc
    layout = Layout(layout)
    try:
        channels, frames, height, width = layout.dims(tuple(shape))
    except ValueError as exc:
        raise BadRequest(f"{path}: {exc}", code="bad_shape") from exc
    if channels != 3:
        raise BadRequest(f"{path}: shape {shape} is not 3-channel in {layout}", code="bad_shape")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return FileSource(fd, offset, Geometry(wire, layout, frames, height, width))
    except BaseException:
        os.close(fd)
        raise
