"""CUDA frames converted where they lie: on their GPU, chunk by chunk, into host staging.

Conversion runs on a stream of the encode's own, one chunk at a time, with the
standard formula in the tensor's dtype: ``(x * 255).clamp(0, 255)``, then the
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
import functools
import logging
from collections.abc import Callable

import torch
from framewire.core.errors import BadRequest
from framewire.core.wire import (
    DType,
    Layout,
)
from framewire.service._convert.convert import slice_frames, to_thwc
from framewire.service._convert.staging import REFUSED, ChunkWriter, Staging
from framewire.service._sources.cuda_faults import classified
from framewire.service._sources.frames import FrameSource, tensor_geometry

log = logging.getLogger("framewire.cuda")


def cuda_available() -> bool:
    return torch.cuda.is_available()


def first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


# ----------------------------------------------------------------------------- the source


class CudaTensorSource(FrameSource):
    """A CUDA tensor, read where it lies. ``event``: producer work to wait for first."""

    close_in_thread = True  # unmapping a producer's memory is driver work

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
        with classified(self.gpu_index), torch.cuda.device(self.device):
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


# Scales float frames into ``out`` (their dtype, their shape), ready for the cast to uint8.
Scale = Callable[[torch.Tensor, torch.Tensor], None]


def standard_scale(x: torch.Tensor, out: torch.Tensor) -> None:
    """Section 3's ``(x * 255).clamp(0, 255)``, in the frames' dtype."""
    torch.mul(x, 255, out=out)
    out.clamp_(0, 255)


class CudaWriter(ChunkWriter):
    """Converts chunks on the source's GPU and copies each into host staging: ``scale``
    then the truncating cast (an engine profile may bring its own scale)."""

    def __init__(self, source: CudaTensorSource, scale: Scale = standard_scale):
        self.source = source
        self.scale = scale
        self.stream: torch.cuda.Stream | None = None
        self.scaled: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None

    def open(self, staging: Staging | None, frames: int) -> None:
        src, g = self.source, self.source.geometry
        samples = 3 * frames * g.height * g.width
        with classified(src.gpu_index), torch.cuda.device(src.device):
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
            # Page-locked once per staging (a session's chunks each bring a writer),
            # unlocked when the staging closes: cudaHostRegister costs ms per MiB.
            if staging is not None and staging.in_flight is not None:
                if staging.pinned_on is None:
                    address, device = staging.address(), src.device
                    staging.pinned_on = REFUSED  # asked once: not again for each chunk
                    if pin_host(address, staging.size, device):
                        staging.pinned_on = device
                        staging.before_close(functools.partial(unpin_host, address, device))
                self.pinned = staging.pinned_on == src.device

    def write(self, take: Callable[[], torch.Tensor], t0: int, t1: int) -> None:
        src, g = self.source, self.source.geometry
        assert self.stream is not None, "open() first"
        with (
            classified(src.gpu_index),
            torch.cuda.device(src.device),
            torch.cuda.stream(self.stream),
        ):
            x = slice_frames(src.frames(), g.layout, t0, t1)
            if self.scaled is not None:
                scaled = self.scaled[: x.numel()].view(x.shape)
                self.scale(x, scaled)
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
        """Wait for our stream (nothing of ours may still read the producer's memory or
        write the staging), then free, whatever the wait raised (the staging unpins
        itself as it closes)."""
        try:
            if self.stream is not None:
                with classified(self.source.gpu_index, refuse=False):
                    self.stream.synchronize()
        finally:
            self.stream = self.scaled = self.packed = None


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
