"""What a caller's video is: its frames' dimensions, dtype and layout, torch or numpy."""

from __future__ import annotations

from typing import Any

import numpy as np
from framewire.client.wire import DType, Layout

NUMPY_DTYPES = {
    np.dtype("float32"): DType.float32,
    np.dtype("float16"): DType.float16,
    np.dtype("uint8"): DType.uint8,
}


def is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def guess_layout(shape: tuple[int, ...], is_uint8: bool, layout: Layout | str | None) -> Layout:
    """CTHW for (3, T, H, W) floats, THWC for (T, H, W, 3) uint8, unless told."""
    if layout is not None:
        return Layout(layout)
    if is_uint8 and shape[-1] == 3:
        return Layout.THWC
    if shape[0] == 3:
        return Layout.CTHW
    if shape[-1] == 3:
        return Layout.THWC
    if shape[1] == 3:
        return Layout.TCHW
    raise ValueError(f"cannot tell the layout of shape {list(shape)}; pass layout=")


def squeeze_batch(shape: tuple[int, ...]) -> int:
    """How many leading dimensions to drop: 1 for a batch of one, else 0."""
    if len(shape) == 5 and shape[0] == 1:
        return 1
    if len(shape) != 4:
        raise ValueError(f"a video is 4-D (or 5-D with a batch of 1), got shape {list(shape)}")
    return 0


def wire_dtype(video: Any) -> DType:
    if is_torch(video):
        name = str(video.dtype).removeprefix("torch.")
        try:
            return DType(name)
        except ValueError:
            raise ValueError(f"unsupported dtype {video.dtype}") from None
    try:
        return NUMPY_DTYPES[np.dtype(video.dtype)]
    except KeyError:
        raise ValueError(f"unsupported dtype {video.dtype}") from None


def as_bytes(video: Any) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A C-contiguous uint8 view (or copy, for strided input) of the raw bytes."""
    if is_torch(video):
        t = video.contiguous()
        import torch

        raw: np.ndarray[Any, np.dtype[np.uint8]] = (
            t.view(torch.uint8).numpy() if t.dtype != torch.uint8 else t.numpy()
        )
        return raw
    return np.ascontiguousarray(video).view(np.uint8)


def is_cuda(video: Any) -> bool:
    return is_torch(video) and video.device.type == "cuda"
