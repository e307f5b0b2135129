"""The vllm-omni profile's compiled float32 conversion gives the engine's own bytes.

vLLM-omni's ``quantize_chunk`` is ``clamp(lo, hi).sub(lo).mul(255 / (hi - lo)).round()``
then the cast, in torch. The compiled kernels (service/_convert/jitted.py
``interleaved`` and ``planar``, given the profile's terms) take float32 blocks in one
pass; each value where rounding flips (every k + 1/2 step, one and two ulps either
side), the ends of the range and the special values must come out as the engine's
formula makes them, on both routes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from framewire.client.wire import Layout
from framewire.service._convert import kernels
from framewire.service._encode.profiles import vllm_omni_convert

from tests.service.encode.test_profiles import encode
from tests.support.engines import vllm_omni_quantize, vllm_omni_save
from tests.support.media import around, make_clip, with_specials

RANGES = [(-1.0, 1.0), (0.0, 1.0), (-0.3, 2.7)]


@pytest.fixture(params=["compiled", "pure"])
def kernel(request: pytest.FixtureRequest) -> object:
    kernels.use(request.param)
    yield request.param
    kernels.use("auto")


def around_every_step(value_range: tuple[float, float]) -> torch.Tensor:
    """float32 values at, and one and two ulps either side of, every rounding step
    (k + 1/2) and every k of the range, its ends beyond, and the special values."""
    low, high = value_range
    k = torch.arange(-2, 258, dtype=torch.float64)
    centres = torch.cat([k, k + 0.5]) * (high - low) / 255 + low
    flat = around(centres.to(torch.float32))
    return flat[: flat.numel() // 3 * 3].reshape(1, 1, -1, 3).contiguous()  # (T, H, W, 3)


LAYOUTS = [Layout.THWC, Layout.CTHW, Layout.TCHW]  # the one-shot save's, a session's chunk


def laid_out(frames: torch.Tensor, layout: Layout) -> torch.Tensor:
    """(T, H, W, 3) ``frames`` in ``layout``, contiguous."""
    order = {Layout.THWC: (0, 1, 2, 3), Layout.CTHW: (3, 0, 1, 2), Layout.TCHW: (0, 3, 1, 2)}
    return frames.permute(*order[layout]).contiguous()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("value_range", RANGES)
def test_every_rounding_step_is_the_engines(kernel, value_range, layout):
    frames = around_every_step(value_range)
    out = torch.empty(frames.shape, dtype=torch.uint8)
    vllm_omni_convert(value_range)(laid_out(frames, layout), layout, out)
    want = vllm_omni_quantize(frames.permute(3, 0, 1, 2), value_range)
    assert np.array_equal(out.numpy(), want)


@pytest.mark.parametrize("layout", [Layout.THWC, Layout.CTHW])
def test_the_compiled_kernel_is_the_one_that_ran(kernel, layout, monkeypatch):
    """Not a silent fallback: with numba here the profile's float32 takes one pass of
    the compiled kernel for its layout (``interleaved`` for a one-shot save's (T, H, W,
    3), ``planar`` for a session's (C, T, H, W)) with the profile's terms, not torch's
    steps; FRAMEWIRE_KERNEL=pure (``kernels.use("pure")``) takes neither."""
    found = kernels.kernels()
    if kernel == "pure":
        assert found is None
        return
    assert found is not None
    ran: list[tuple[str, tuple[float, ...]]] = []

    def spy(name: str, real: Any) -> Any:
        def counted(*args: Any) -> None:
            ran.append((name, tuple(float(v) for v in args[-1])))
            real(*args)

        return counted

    planar, interleaved = found
    spies = (spy("planar", planar), spy("interleaved", interleaved))
    monkeypatch.setattr(kernels, "kernels", lambda: spies)
    frames = around_every_step((-1.0, 1.0))
    out = torch.empty(frames.shape, dtype=torch.uint8)
    vllm_omni_convert((-1.0, 1.0))(laid_out(frames, layout), layout, out)
    name = "interleaved" if layout is Layout.THWC else "planar"
    assert ran == [(name, (-1.0, 1.0, 127.5))]
    assert np.array_equal(out.numpy(), vllm_omni_quantize(frames.permute(3, 0, 1, 2), (-1.0, 1.0)))


@pytest.mark.parametrize("route", ["stream", "fallback"])
def test_a_thwc_float32_clip_encodes_to_the_engines_bytes(tmp_path: Path, kernel, route):
    """What vLLM-omni's one-shot save hands over, (T, H, W, 3) float32, end to end."""
    clip = with_specials(make_clip(9, 32, 48, dtype=torch.float32) * 2.2 - 1.1)
    frames = clip.permute(1, 2, 3, 0).contiguous()
    want = vllm_omni_save(vllm_omni_quantize(clip, (-1.0, 1.0)), tmp_path / "v.mp4", fps=16)
    params = {"fps": 16, "profile": "vllm-omni", "value_range": (-1.0, 1.0)}
    got = encode(route, frames, tmp_path / "fw.mp4", layout=Layout.THWC, **params)
    assert got == want
