"""Each engine profile's float-to-rgb24 conversion, one small function apiece.

``imageio`` and ``sglang`` convert as section 3 of the contract says
(``convert.convert_into``, its compiled kernel and the GPU writer). The other
two differ, and are followed exactly as their engines write them (docs/engines.md):

- ``diffusers`` (``export_to_video``): ``(frame * 255).astype(np.uint8)`` with
  numpy in float32 and without a clamp, so out-of-range values wrap as numpy's
  cast makes them. float16 and bfloat16 are widened to float32 first, as a
  pipeline's ``output_type="np"`` (``.float().numpy()``) hands them over. uint8
  frames are its PIL route: taken as they are.
- ``vllm-omni`` (``chunked_video.quantize_chunk``): ``clamp(lo, hi).sub(lo)
  .mul(255 / (hi - lo)).round()`` in the tensor's dtype (round half to even),
  then the cast. uint8 frames are taken as they are.

Both are elementwise, so any block or chunk split gives the same bytes.
diffusers' runs on the host for every source (a CUDA source's blocks are
copied over first: numpy's wrap of out-of-range values is the host's);
vLLM-omni's on the GPU for a CUDA source (the same steps, rounded the same
there), as the standard conversion does.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from framewire.core.wire import Layout
from framewire.service._convert.convert import compiled_into, interleave_into
from framewire.service._convert.staging import ChunkWriter
from framewire.service._encode.pump import HostWriter
from framewire.service._sources.cuda_convert import CudaTensorSource, CudaWriter, Scale
from framewire.service._sources.frames import FrameSource, TensorSource

Convert = Callable[[torch.Tensor, Layout, torch.Tensor], None]
DEFAULT_VALUE_RANGE = (-1.0, 1.0)  # vLLM-omni's Wan VAEs, and its serving path's guess
# The vllm-omni profile's encoder, a PyAV child, run by its file: it imports av and numpy
# alone (0.2 s of CPU to start, where ``-m`` first ran the framewire.client and
# framewire.service packages' imports: 0.6 s). -P keeps the working directory and the
# script's folder off sys.path, so no module planted there (an av.py in /tmp) runs in it.
PYAV_CHILD = (sys.executable, "-P", str(Path(__file__).with_name("pyav_writer.py")))
# The template its writers are forked from (service/_encode/forks.py), run alike.
PYAV_TEMPLATE = (sys.executable, "-P", str(Path(__file__).with_name("pyav_template.py")))


def diffusers_convert(chunk: torch.Tensor, layout: Layout, out: torch.Tensor) -> None:
    """diffusers' ``export_to_video``: ``(frame * 255).astype(np.uint8)``."""
    if chunk.dtype == torch.uint8:
        interleave_into(chunk, layout, out)
        return
    x = chunk.float()  # a pipeline's output_type="np" is float32 whatever its dtype
    with np.errstate(invalid="ignore", over="ignore"):  # wrapping is the point
        cast = (x.numpy() * 255).astype(np.uint8)
    interleave_into(torch.from_numpy(cast), layout, out)


def _vllm_omni_terms(value_range: tuple[float, float]) -> tuple[float, float, float]:
    """``quantize_chunk``'s low, high and scale, ``255 / (hi - lo)``, as Python floats."""
    low, high = float(value_range[0]), float(value_range[1])
    return low, high, 255.0 / (high - low)


def vllm_omni_scale(value_range: tuple[float, float]) -> Scale:
    """vLLM-omni's ``quantize_chunk`` up to its cast: ``clamp(lo, hi).sub(lo).mul(255 /
    (hi - lo)).round()``, each step in the frames' dtype, on whichever device they are
    (elementwise, rounded the same on a GPU)."""
    low, high, scale = _vllm_omni_terms(value_range)

    def into(x: torch.Tensor, out: torch.Tensor) -> None:
        torch.clamp(x, low, high, out=out)
        out.sub_(low).mul_(scale).round_()

    return into


def vllm_omni_convert(value_range: tuple[float, float]) -> Convert:
    """vLLM-omni's ``quantize_chunk`` for a VAE whose output spans ``value_range``.

    float32 blocks (its one-shot save's (T, H, W, 3) frames, its session's (C, T, H, W)
    chunks) go through a compiled kernel where there is one (``jitted.interleaved`` or
    ``jitted.planar``, with these terms: one pass, a tenth of torch's CPU for these five
    steps, their temporaries and the interleave); the rest through torch, with the same
    bytes."""
    scale_into = vllm_omni_scale(value_range)
    # float32, as torch casts a float32 tensor's scalar operands
    low, high, scale = (np.float32(v) for v in _vllm_omni_terms(value_range))

    def convert(chunk: torch.Tensor, layout: Layout, out: torch.Tensor) -> None:
        if chunk.dtype == torch.float32 and compiled_into(chunk, layout, out, (low, high, scale)):
            return
        if chunk.dtype != torch.uint8:
            scaled = torch.empty_like(chunk)
            scale_into(chunk, scaled)
            chunk = scaled.to(torch.uint8)
        interleave_into(chunk, layout, out)

    return convert


def conversion(profile: str, value_range: tuple[float, float] | None = None) -> Convert | None:
    """The profile's own conversion; None for section 3's (``convert_into``)."""
    if profile == "diffusers":
        return diffusers_convert
    if profile == "vllm-omni":
        return vllm_omni_convert(value_range or DEFAULT_VALUE_RANGE)
    return None


def profile_writer(
    source: FrameSource, profile: str, value_range: tuple[float, float] | None = None
) -> ChunkWriter | None:
    """The converter ``profile`` needs for ``source``; None: the source's own or the
    host's standard conversion."""
    convert = conversion(profile, value_range)
    if convert is None:
        return None
    if isinstance(source, CudaTensorSource):
        if profile == "vllm-omni":
            # Converted where the frames are, as the standard profile is: a chunk's
            # uint8 crosses to the host, not its floats.
            return CudaWriter(source, vllm_omni_scale(value_range or DEFAULT_VALUE_RANGE))
        return CopiedChunkWriter(source, convert)
    return HostWriter(source, convert)


class CopiedChunkWriter(ChunkWriter):
    """A CUDA source under a profile converted on the host (diffusers'): each chunk
    crosses to the host in one copy, not one synchronous copy per cache-sized block,
    then converts as host frames do."""

    def __init__(self, source: FrameSource, convert: Convert):
        self.source = source
        self._host = HostWriter(source, convert)  # its buffers, kept for every chunk

    def write(self, take: Callable[[], torch.Tensor], t0: int, t1: int) -> None:
        chunk, _ = self.source.read(t0, t1)  # one device-to-host copy of the chunk
        self._host.source = TensorSource(chunk, self.source.geometry.layout)
        self._host.write(take, 0, t1 - t0)
