"""Handing a CUDA tensor to the worker through CUDA IPC, without copying it.

The tensor's storage is shared with ``UntypedStorage._share_cuda_()`` and its
fields go to the worker spelled out (bytes as base64), with where the tensor
sits in that storage and the GPU's UUID: device indices differ between
processes. Nothing is pickled. Work still queued on the caller's stream is
waited for first, so the worker sees the finished frames; the caller keeps the
tensor alive and unmodified for the whole call.

Sharing arms one of torch's IPC reference counters in this process, and torch
keeps the memory out of reuse until a consumer counts it down. The worker reads
the tensor only until it answers and never touches that counter, so leaving
the context releases it here, exactly once, whatever happened: a request that
was refused, or never reached the worker, strands no GPU memory.
"""

from __future__ import annotations

import base64
from typing import Any

from framewire.core.frames import describe as describe_video
from framewire.core.wire import CudaIpcSource, DType, Layout, normalize_uuid

# What ``UntypedStorage._share_cuda_()`` returns, in order.
ShareFields = tuple[int, bytes, int, int, bytes, int, bytes, bool]


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def describe(
    fields: ShareFields,
    *,
    dtype: DType,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    tensor_offset: int,
    layout: Layout,
    device_uuid: object,
) -> CudaIpcSource:
    """The wire descriptor of a shared storage and of the tensor inside it."""
    device, handle, size, offset, ref_counter, ref_offset, event, event_sync = fields
    return CudaIpcSource(
        dtype=dtype,
        shape=list(shape),
        layout=layout,
        device=device,
        device_uuid=normalize_uuid(device_uuid),
        handle=_b64(handle),
        storage_size_bytes=size,
        storage_offset_bytes=offset,
        ref_counter_handle=_b64(ref_counter) if ref_counter else None,
        ref_counter_offset=ref_offset,
        # Without the flag torch leaves the event bytes unset: not worth sending.
        event_handle=_b64(event) if event_sync else None,
        event_sync_required=bool(event_sync),
        tensor_offset=tensor_offset,
        stride=list(stride),
    )


class CudaShare:
    """Context manager: a :class:`CudaIpcSource` for a CUDA tensor while the block runs.

    Built on the caller's thread, which names the stream to wait for (torch's
    current stream is per thread); may be entered on another one.
    """

    def __init__(self, video: Any, *, layout: Layout | str | None = None):
        import torch

        if video.layout != torch.strided:
            raise ValueError(f"only dense (strided) tensors can be shared, not {video.layout}")
        frames = describe_video(video, layout)
        self.video, self.dtype, self.layout = frames.video, frames.dtype, frames.layout
        self.stream = torch.cuda.current_stream(self.video.device)
        self._counter: tuple[bytes, int] | None = None

    def __enter__(self) -> CudaIpcSource:
        import torch

        video = self.video
        with torch.cuda.stream(self.stream):
            self.stream.synchronize()
            try:
                fields = video.untyped_storage()._share_cuda_()
            except RuntimeError as exc:
                raise ValueError(f"this CUDA tensor cannot be shared over IPC: {exc}") from exc
        self._counter = (fields[4], fields[5])
        try:
            return describe(
                fields,
                dtype=self.dtype,
                shape=tuple(video.shape),
                stride=tuple(video.stride()),
                tensor_offset=video.storage_offset(),
                layout=self.layout,
                device_uuid=torch.cuda.get_device_properties(video.device).uuid,
            )
        except BaseException:
            self.release()
            raise

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Count the worker's use down; a no-op after the first call."""
        if self._counter is None:
            return
        import torch

        handle, offset = self._counter
        self._counter = None
        torch.UntypedStorage._release_ipc_counter_cuda(handle, offset)
