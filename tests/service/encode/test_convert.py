"""Chunked conversion equals the whole-clip reference conversion, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from framewire.client.wire import Layout
from framewire.service._encode.convert import chunk_frames, convert_into

from tests.support.media import make_clip, reference_uint8

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
SPECIALS = [
    float("nan"),
    float("inf"),
    -float("inf"),
    -0.5,
    -0.0,
    1.0,
    1.5,
    0.999999,
    0.5 / 255,
    254.5 / 255,
    1e-8,
    3e38,
]


def with_specials(clip: torch.Tensor) -> torch.Tensor:
    flat = clip.clone().view(-1)
    specials = torch.tensor(SPECIALS, dtype=torch.float32).to(clip.dtype)
    flat[: len(specials)] = specials
    flat[-len(specials) :] = specials
    return flat.view(clip.shape)


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
