"""Handing a CUDA tensor to the worker through CUDA IPC, without copying it.

The tensor's storage is shared with ``UntypedStorage._share_cuda_()`` and its
fields go to the worker spelled out (bytes as base64), with where the tensor
sits in that storage and the GPU's UUID: device indices differ between
processes. Nothing is pickled. An interprocess event recorded on the caller's
stream goes with it, which the worker's stream waits on before it reads: the
worker sees the finished frames and the caller never stalls; the caller keeps
the tensor alive and unmodified for the whole call.

Sharing arms one of torch's IPC reference counters in this process, and torch
keeps the memory out of reuse until a consumer counts it down. The worker reads
the tensor only until it answers and never touches that counter, so leaving
the context releases it here, exactly once: at once when the worker answered
(or was never reached), so a refused request strands no GPU memory. When the
call ended without an answer (cancelled, timed out, the connection lost) the
worker may still be reading it: the share goes to ``release_later``
(client/_release.py), which releases it only once the worker says it has let go of it
and never will read it.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Callable
from typing import Any

from framewire.client._calls import UNSENT
from framewire.core.errors import Unavailable
from framewire.core.frames import describe as describe_video
from framewire.core.wire import CudaIpcSource, DType, Layout, normalize_uuid


class NotShareable(ValueError):
    """torch refuses to share this CUDA tensor's storage: one this process received over
    IPC itself, or memory its caching allocator did not make (a VMM-based pool). Its
    frames can still go a chunk at a time through the host (client/_stream.py)."""


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
    share_id: str | None = None,
    torch_version: str | None = None,
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
        share_id=share_id,
        torch_version=torch_version,
    )


def worker_may_read(exc: BaseException | None) -> bool:
    """Whether the worker may still read what a call shared, the call having ended with
    ``exc``: it was cancelled or interrupted (the request may be on its way or running),
    or its answer was lost after it was sent. An answer, even a refusal, means the
    worker closed what it opened first."""
    if exc is None:
        return False
    if not isinstance(exc, Exception):  # GeneratorExit, CancelledError, KeyboardInterrupt
        return True
    if isinstance(exc, Unavailable) and exc.code == "unavailable":
        return not isinstance(exc.__cause__, UNSENT)  # unsent: the worker never had it
    return False


class CudaShare:
    """Context manager: a :class:`CudaIpcSource` for a CUDA tensor while the block runs.

    Built on the caller's thread, which names the stream to wait for (torch's
    current stream is per thread); may be entered on another one.
    """

    def __init__(
        self,
        video: Any,
        *,
        layout: Layout | str | None = None,
        release_later: Callable[[CudaShare], None] | None = None,
    ):
        import torch

        if video.layout != torch.strided:
            raise ValueError(f"only dense (strided) tensors can be shared, not {video.layout}")
        frames = describe_video(video, layout)
        self.video, self.dtype, self.layout = frames.video, frames.dtype, frames.layout
        self.stream = torch.cuda.current_stream(self.video.device)
        self.share_id = secrets.token_hex(16)
        self.release_later = release_later  # None: released at once, whatever happened
        self._counter: tuple[bytes, int] | None = None
        self._event: Any = None  # the worker's to wait on; kept until the release

    def __enter__(self) -> CudaIpcSource:
        import torch

        video = self.video
        with torch.cuda.stream(self.stream):
            try:
                fields = video.untyped_storage()._share_cuda_()
            except RuntimeError as exc:
                raise NotShareable(f"this CUDA tensor cannot be shared over IPC: {exc}") from exc
            self._counter = (fields[4], fields[5])
        try:
            # The worker waits on this event on its GPU, so the work queued here so far is
            # done before it reads, and this thread never waits: torch's own event is
            # recorded only when a storage is first shared, not at each share.
            with torch.cuda.stream(self.stream):
                self._event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
                self._event.record(self.stream)
            fields = (*fields[:6], bytes(self._event.ipc_handle()), True)
            return describe(
                fields,
                dtype=self.dtype,
                shape=tuple(video.shape),
                stride=tuple(video.stride()),
                tensor_offset=video.storage_offset(),
                layout=self.layout,
                device_uuid=torch.cuda.get_device_properties(video.device).uuid,
                share_id=self.share_id,
                torch_version=torch.__version__,
            )
        except BaseException:
            self.release()
            raise

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        self.end(exc)

    def end(self, exc: BaseException | None) -> None:
        """The call that shared it ended with ``exc`` (None: answered): release now, or
        once the worker has let go of it."""
        if self._counter is not None and self.release_later and worker_may_read(exc):
            self.release_later(self)
        else:
            self.release()

    def release(self) -> None:
        """Count the worker's use down; a no-op after the first call."""
        if self._counter is None:
            return
        import torch

        handle, offset = self._counter
        self._counter = self._event = None
        torch.UntypedStorage._release_ipc_counter_cuda(handle, offset)
