"""Float video tensors to rgb24 frames, chunk by chunk, byte-identical to the reference.

The standard conversion is ``(x * 255).clamp(0, 255).to(torch.uint8)`` in the
tensor's own dtype, then a permute to (T, H, W, 3). It is elementwise, so any
split over T gives the same bytes. float32 goes through a compiled single-pass
kernel when numba is there (``kernels.py``). Otherwise, and for the narrow
floats: scale and clamp into scratch, then cast and interleave in one pass,
numpy's strided cast-assignment straight into the staging buffer (bfloat16,
which numpy lacks, is cast by torch's ``copy_`` first: the same truncating
kernel as ``.to(torch.uint8)``). Tests pin every route to the reference, NaN
and out-of-range values included.
"""

from __future__ import annotations

import numpy as np
import torch
from framewire.core.wire import DType, Layout
from framewire.service._convert import kernels

TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.float32: torch.float32,
    DType.float16: torch.float16,
    DType.bfloat16: torch.bfloat16,
    DType.uint8: torch.uint8,
}
WIRE_DTYPES: dict[torch.dtype, DType] = {v: k for k, v in TORCH_DTYPES.items()}


def chunk_frames(budget: int, height: int, width: int, itemsize: int) -> int:
    """Frames per chunk so that temporaries, 3·H·W·(itemsize + 2) bytes a frame, fit the budget.

    The 2 is the two uint8 staging slots (one converting, one being sent).
    """
    per_frame = 3 * height * width * (itemsize + 2)
    return max(1, budget // per_frame)


def to_thwc(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A (T, H, W, 3) view of a tensor in ``layout``."""
    if layout is Layout.CTHW:
        return x.permute(1, 2, 3, 0)
    if layout is Layout.TCHW:
        return x.permute(0, 2, 3, 1)
    return x


def slice_frames(x: torch.Tensor, layout: Layout, t0: int, t1: int) -> torch.Tensor:
    return x[:, t0:t1] if layout is Layout.CTHW else x[t0:t1]


def interleave_into(planes: torch.Tensor, layout: Layout, out: torch.Tensor) -> None:
    """``planes`` in ``layout`` into ``out``, (t, H, W, 3): uint8, or floats in [0, 255] that
    numpy casts (truncating) on the way.

    For planar layouts numpy's three strided assignments are about twice as
    fast as torch's generic permuted copy (measured on 1344-wide rows).
    """
    if layout is Layout.THWC:
        out.copy_(planes)
        return
    src, dst = planes.numpy(), out.numpy()
    for c in range(3):
        dst[..., c] = src[c] if layout is Layout.CTHW else src[:, c]


def convert_into(
    chunk: torch.Tensor,
    layout: Layout,
    out: torch.Tensor,
    *,
    scratch: torch.Tensor | None = None,
    planes: torch.Tensor | None = None,
    inplace: bool = False,
) -> None:
    """Write ``chunk`` (in ``layout``) into ``out``, a (t, H, W, 3) uint8 tensor.

    ``inplace`` lets the scaling run in ``chunk`` itself (a buffer we own);
    otherwise ``scratch`` (at least ``chunk.numel()`` of its dtype) takes it, so
    the caller's tensor is never written. ``planes`` (uint8, at least
    ``chunk.numel()``) holds a bfloat16 block's cast before the interleave.
    """
    if chunk.dtype == torch.uint8:
        interleave_into(chunk, layout, out)
        return
    if chunk.dtype == torch.float32 and compiled_into(chunk, layout, out):
        return
    if inplace:
        scaled = chunk.mul_(255)
    else:
        fits = scratch is not None and scratch.numel() >= chunk.numel()
        target = scratch[: chunk.numel()].view(chunk.shape) if fits else None  # type: ignore[index]
        scaled = torch.mul(chunk, 255, out=target) if target is not None else chunk * 255
    scaled.clamp_(0, 255)
    if layout is Layout.THWC:
        out.copy_(scaled)
        return
    if scaled.dtype == torch.bfloat16:
        if planes is None or planes.numel() < chunk.numel():
            cast = scaled.to(torch.uint8)
        else:
            cast = planes[: chunk.numel()].view(chunk.shape)
            cast.copy_(scaled)
        interleave_into(cast, layout, out)
        return
    with np.errstate(invalid="ignore"):  # NaN: cast as the platform casts it, like torch
        interleave_into(scaled, layout, out)


def compiled_into(
    chunk: torch.Tensor, layout: Layout, out: torch.Tensor, terms: kernels.Terms | None = None
) -> bool:
    """Convert float32 ``chunk`` with a compiled kernel if there is one for this block;
    whether it did. ``terms``: vLLM-omni's (low, high, scale) for its rounded
    quantization (the vllm-omni profile), else the standard conversion."""
    found = kernels.kernels()
    if found is None or not out.is_contiguous():
        return False
    planar, interleaved = found
    dst = out.numpy().reshape(-1)
    if layout is Layout.THWC:
        if not chunk.is_contiguous():
            return False
        interleaved(chunk.numpy().reshape(-1), dst, terms or kernels.STANDARD)
        return True
    planes = chunk if layout is Layout.CTHW else chunk.permute(1, 0, 2, 3)
    if planes.stride(3) != 1:
        return False
    plane, frame, row, _ = planes.stride()
    _, frames, rows, width = planes.shape
    # One flat run from the block's first element to its last, for the kernel's indexing.
    span = 2 * plane + (frames - 1) * frame + (rows - 1) * row + width
    flat = np.lib.stride_tricks.as_strided(planes.numpy(), shape=(span,), strides=(4,))
    planar(flat, plane, frame, row, (frames, rows, width), dst, terms or kernels.STANDARD)
    return True


def single_threaded_conversion() -> None:
    """Give torch one intra-op thread in this process (the worker, the local CLI).

    Blocks are cache-sized, so a second thread gains nothing there, while x264's
    frame threads need every core: measured on 2 cores, torch's default pool
    cost about twice the CPU for the same conversion.
    """
    torch.set_num_threads(1)
