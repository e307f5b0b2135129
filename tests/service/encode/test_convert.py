"""Chunked conversion equals the whole-clip standard conversion, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from framewire.client.wire import Layout
from framewire.service._convert import kernels
from framewire.service._convert.convert import chunk_frames, convert_into

from tests.support.media import around, make_clip, reference_uint8, with_specials

FLOATS = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True, params=["compiled", "pure"])
def kernel(request: pytest.FixtureRequest) -> object:
    """Every conversion test runs on both routes: the compiled kernel and the pure one."""
    kernels.use(request.param)
    yield request.param
    kernels.use("auto")


@pytest.mark.parametrize("dtype", [*FLOATS, torch.uint8])
@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("per_chunk", [1, 3, 7])
def test_chunks_match_reference(dtype, layout, per_chunk):
    clip = make_clip(frames=7, height=9, width=13, dtype=dtype, layout=layout)
    if dtype != torch.uint8:
        clip = with_specials(clip)
    expected = reference_uint8(clip, layout)
    out = torch.empty(7, 9, 13, 3, dtype=torch.uint8)
    before = clip.clone()
    for t0 in range(0, 7, per_chunk):
        t1 = min(t0 + per_chunk, 7)
        chunk = clip[:, t0:t1] if layout is Layout.CTHW else clip[t0:t1]
        convert_into(chunk, layout, out[t0:t1])
    assert np.array_equal(out.numpy(), expected)
    assert torch.equal(clip.view(torch.uint8), before.view(torch.uint8)), "input was modified"


@pytest.mark.parametrize("dtype", FLOATS)
def test_inplace_and_scratch_routes_agree(dtype):
    clip = with_specials(make_clip(frames=4, dtype=dtype))
    expected = reference_uint8(clip, Layout.CTHW)
    out = torch.empty(4, 48, 64, 3, dtype=torch.uint8)
    convert_into(clip.clone(), Layout.CTHW, out, inplace=True)
    assert np.array_equal(out.numpy(), expected)
    scratch = torch.empty(clip.numel() * 2, dtype=dtype)
    out.zero_()
    convert_into(clip, Layout.CTHW, out, scratch=scratch)
    assert np.array_equal(out.numpy(), expected)


def test_numpy_float16_matches_torch():
    clip = with_specials(make_clip(frames=3, dtype=torch.float16))
    out = torch.empty(3, 48, 64, 3, dtype=torch.uint8)
    convert_into(torch.from_numpy(clip.numpy()), Layout.CTHW, out)
    assert np.array_equal(out.numpy(), reference_uint8(clip, Layout.CTHW))


@pytest.mark.parametrize("layout", list(Layout))
def test_planes_buffer_route(layout):
    clip = with_specials(make_clip(frames=3, height=9, width=13, layout=layout))
    out = torch.empty(3, 9, 13, 3, dtype=torch.uint8)
    planes = torch.empty(clip.numel(), dtype=torch.uint8)
    convert_into(clip, layout, out, planes=planes, scratch=torch.empty(clip.numel()))
    assert np.array_equal(out.numpy(), reference_uint8(clip, layout))


def test_chunk_budget():
    # 3*H*W*(itemsize+2) bytes a frame
    assert chunk_frames(128 << 20, 768, 1344, 4) == (128 << 20) // (3 * 768 * 1344 * 6)
    assert chunk_frames(1, 768, 1344, 4) == 1
    assert chunk_frames(3 * 48 * 64 * 6 * 3, 48, 64, 4) == 3
    assert chunk_frames(3 * 48 * 64 * 3 * 3, 48, 64, 1) == 3


def steps_around_every_byte() -> torch.Tensor:
    """float32 values one and two ulps either side of every k / 255 and k / 255 + 1/510,
    where a cast's truncation flips, with the special values."""
    base = torch.arange(256, dtype=torch.float64)
    return around(torch.cat([base / 255, (base + 0.5) / 255]).to(torch.float32))


@pytest.mark.parametrize("layout", list(Layout))
def test_every_truncation_boundary_matches_the_reference(layout):
    values = steps_around_every_byte()
    n = values.numel() // 3 * 3
    thwc = values[:n].view(1, 1, -1, 3)  # (T, H, W, 3)
    clip = {Layout.THWC: thwc, Layout.CTHW: thwc.permute(3, 0, 1, 2),
            Layout.TCHW: thwc.permute(0, 3, 1, 2)}[layout].contiguous()  # fmt: skip
    out = torch.empty(1, 1, n // 3, 3, dtype=torch.uint8)
    convert_into(clip, layout, out)
    assert np.array_equal(out.numpy(), reference_uint8(clip, layout))


def test_strided_blocks_of_a_larger_clip(kernel):
    """Row blocks of one frame and permuted planes: what the pump hands the converter."""
    clip = with_specials(make_clip(frames=3, height=20, width=31))
    expected = reference_uint8(clip, Layout.CTHW)
    out = torch.empty(3, 20, 31, 3, dtype=torch.uint8)
    for t in range(3):
        for r0 in range(0, 20, 7):
            convert_into(clip[:, t : t + 1, r0 : r0 + 7], Layout.CTHW, out[t : t + 1, r0 : r0 + 7])
    assert np.array_equal(out.numpy(), expected)
    tchw = clip.permute(1, 0, 2, 3).contiguous()
    out.zero_()
    convert_into(tchw[:, :, 3:11], Layout.TCHW, out[:, 3:11])
    assert np.array_equal(out.numpy()[:, 3:11], expected[:, 3:11])


def test_the_compiled_kernel_is_the_one_that_ran(kernel):
    """Not a silent fallback: with numba here the compiled kernel is really taken."""
    if kernel == "compiled":
        assert kernels.kernels() is not None
    else:
        assert kernels.kernels() is None
