"""What a caller's video is (its frames' dimensions, dtype and layout, torch or numpy),
and its audio as samples."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
from framewire.core.wire import DType, Layout

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


def is_cuda(video: Any) -> bool:
    return is_torch(video) and video.device.type == "cuda"


@dataclass(frozen=True)
class Frames:
    """A caller's video as the wire describes it: 4-D, its dtype, layout and dimensions."""

    video: Any  # the tensor or array, a leading batch of 1 dropped
    dtype: DType
    layout: Layout
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """(channels, frames, height, width)."""
        return self.layout.dims(self.shape)

    @property
    def frame_bytes(self) -> int:
        _, frames, _, _ = self.dims
        return self.nbytes // max(1, frames)

    def span(self, t0: int, t1: int) -> Any:
        """Frames ``[t0, t1)`` of the video, a view in its layout (no copy)."""
        return self.video[:, t0:t1] if self.layout is Layout.CTHW else self.video[t0:t1]


def on_host(frames: Frames) -> Frames:
    """``frames`` copied from their GPU to host memory (one chunk: a bounded copy)."""
    return dataclasses.replace(frames, video=frames.video.to("cpu"))


def describe(video: Any, layout: Layout | str | None = None) -> Frames:
    """What ``video`` is; raises ValueError for what cannot be a video."""
    video = video[0] if squeeze_batch(tuple(video.shape)) else video
    shape = tuple(int(n) for n in video.shape)
    dtype = wire_dtype(video)
    return Frames(video, dtype, guess_layout(shape, dtype is DType.uint8, layout), shape)


def copy_into(mapping: Any, frames: Frames) -> None:
    """Copy ``frames``' bytes to the start of a writable buffer (a shared mapping), in
    one pass even when they are strided (a time slice of a larger clip)."""
    if frames.nbytes > len(mapping):
        raise ValueError(f"{frames.nbytes} bytes of frames for a buffer of {len(mapping)}")
    video = frames.video
    if is_torch(video):
        import torch

        if video.device.type != "cpu" or video.dtype == torch.bfloat16:  # numpy has none
            raw = torch.frombuffer(mapping, dtype=torch.uint8, count=frames.nbytes)
            with torch.no_grad():  # a tensor that requires grad is copied as plain data
                raw.view(video.dtype).view(video.shape).copy_(video)
            return
        # numpy's copy, on this thread: torch's own runs on its intra-op pool, whose
        # OpenMP threads then spin between copies on the cores the worker encodes on
        # (0.9 CPU-s of a 120-frame 1344x768 float clip's 1.3 in this process, measured).
        video = video.detach().numpy()
    target = np.frombuffer(mapping, np.dtype(video.dtype), count=video.size)
    np.copyto(target.reshape(video.shape), video)


def contiguous_bytes(video: Any) -> memoryview | None:
    """The bytes of a contiguous host array or tensor, without a copy; else None."""
    if is_torch(video):
        if video.device.type != "cpu" or not video.is_contiguous():
            return None
        import torch

        raw = video.detach().reshape(-1).view(torch.uint8).numpy()
    elif isinstance(video, np.ndarray) and video.flags.c_contiguous:
        raw = video.reshape(-1).view(np.uint8)
    else:
        return None
    return memoryview(raw)


class MappedBuffer:
    """A writable shared mapping (``_map``) that a caller's bytes are copied into: the
    memfds of the fd handover and the named segments share it."""

    _map: Any

    def write(self, frames: Frames) -> None:
        """Copy ``frames``' bytes to the start."""
        assert self._map is not None
        copy_into(self._map, frames)

    def write_bytes(self, raw: Any) -> None:
        """Copy raw bytes (a uint8 array, say) to the start."""
        assert self._map is not None
        view = memoryview(raw).cast("B")
        self._map[: len(view)] = view


def waveform(audio: Any) -> np.ndarray:
    """``audio`` (a tensor or array, ``[samples]`` or ``[samples, channels]``) as a C-ordered
    float32 or int16 array of two dimensions. Other float dtypes become float32, as
    SGLang's ``.float()`` makes them."""
    if is_torch(audio):
        audio = audio.detach()
        if audio.is_floating_point():
            audio = audio.float()
        audio = audio.cpu().numpy()
    samples = np.asarray(audio)
    if samples.ndim == 1:
        samples = samples[:, None]
    if samples.ndim != 2:
        raise ValueError(f"audio is [samples] or [samples, channels], got {list(samples.shape)}")
    if samples.dtype.kind == "f":
        samples = samples.astype(np.float32, copy=False)
    elif samples.dtype != np.int16:
        raise ValueError(f"audio samples are float or int16, got {samples.dtype}")
    return np.ascontiguousarray(samples)
