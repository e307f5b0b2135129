"""The encode contract: every route's bytes equal imageio.mimsave's (docs/byte-exactness.md)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from framewire.client.wire import DType, Layout
from framewire.core.media.argv import x264_auto_threads
from framewire.service._convert.convert import WIRE_DTYPES
from framewire.service._encode.encoder import EncodeParams, Encoder
from framewire.service._sources.frames import FileSource, Geometry, TensorSource
from framewire.service._sources.shm import open_shm

from tests.support.media import make_clip, reference_mp4, sha256
from tests.support.segments import Segments, raw_bytes

FRAME_64x48 = 3 * 64 * 48


def file_source(
    segments: Segments, clip: torch.Tensor, layout: Layout, offset: int = 0
) -> FileSource:
    """``clip`` at ``offset`` of a new shm segment, opened as the worker opens one."""
    key = segments.write(b"\x00" * offset + raw_bytes(clip))
    _c, t, h, w = layout.dims(tuple(clip.shape))
    geometry = Geometry(WIRE_DTYPES[clip.dtype], layout, t, h, w)
    return FileSource(open_shm(key, ["/framewire-test-"]), offset, geometry)


def check(
    tmp_path: Path,
    clip: torch.Tensor,
    *,
    layout: Layout = Layout.CTHW,
    chunk_bytes: int = 128 << 20,
    source=None,
    **params,
) -> str:
    encoder = Encoder(chunk_bytes=chunk_bytes, fallback=False)
    out = tmp_path / "fast.mp4"
    result = encoder.encode(source or TensorSource(clip, layout), out, EncodeParams(**params))
    assert result.route == "stream"
    ref = reference_mp4(clip, tmp_path / "ref.mp4", layout=layout, **params)
    assert result.sha256 == sha256(out) == ref
    assert result.bytes == out.stat().st_size
    return ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8])
def test_each_dtype(tmp_path, dtype):
    check(tmp_path, make_clip(dtype=dtype), fps=24)


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_each_layout(tmp_path, layout, dtype):
    check(tmp_path, make_clip(dtype=dtype, layout=layout), layout=layout, fps=24)


@pytest.mark.parametrize(("width", "height"), [(64, 48), (100, 75)])
@pytest.mark.parametrize("fps", [24, 23.976, 16])
def test_sizes_and_rates(tmp_path, width, height, fps):
    check(tmp_path, make_clip(frames=5, height=height, width=width), fps=fps)


@pytest.mark.parametrize("quality", [3, 5, 8])
@pytest.mark.parametrize("preset", ["fast", "ultrafast"])
def test_quality_and_preset(tmp_path, quality, preset):
    check(tmp_path, make_clip(height=75, width=100), fps=24, quality=quality, preset=preset)


@pytest.mark.parametrize("chunk_frames", [1, 3, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_chunk_budgets(tmp_path, chunk_frames, dtype):
    itemsize = WIRE_DTYPES[dtype].itemsize
    frames = 8
    per_frame = FRAME_64x48 * (itemsize + 2)
    budget = per_frame * (chunk_frames or frames)
    check(tmp_path, make_clip(frames=frames, dtype=dtype), chunk_bytes=budget, fps=24)


def test_chunk_budget_one_byte_is_one_frame(tmp_path):
    check(tmp_path, make_clip(frames=4, height=75, width=100), chunk_bytes=1, fps=23.976)


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_with_audio(tmp_path, wav, dtype):
    check(tmp_path, make_clip(frames=24, dtype=dtype), fps=24, audio=wav)


def test_pinned_threads(tmp_path):
    check(tmp_path, make_clip(height=75, width=100), fps=24, threads=1)
    check(tmp_path, make_clip(height=75, width=100), fps=24, threads=3)


def test_numpy_input(tmp_path):
    clip = make_clip(dtype=torch.float16)
    check(tmp_path, clip, source=TensorSource(clip.numpy()), fps=24)


def test_non_contiguous_tensor(tmp_path):
    big = make_clip(frames=6, height=48, width=128)
    clip = big[:, :, :, ::2]  # strided view, never copied by the caller
    assert not clip.is_contiguous()
    check(tmp_path, clip, fps=24)


def test_odd_size_values_out_of_range_and_nan(tmp_path):
    clip = make_clip(frames=4, height=17, width=30) * 1.6 - 0.3
    clip.view(-1)[::97] = float("nan")
    clip.view(-1)[5::89] = float("inf")
    check(tmp_path, clip, fps=24, chunk_bytes=1)


@pytest.mark.parametrize(
    ("dtype", "layout", "chunk"),
    [
        (torch.float32, Layout.CTHW, 1),
        (torch.float32, Layout.CTHW, 128 << 20),
        (torch.float16, Layout.TCHW, 2),
        (torch.bfloat16, Layout.THWC, 3),
        (torch.uint8, Layout.CTHW, 1),
        (torch.uint8, Layout.THWC, 1),  # zero-copy: sent straight from the segment
    ],
)
def test_from_shared_memory(tmp_path, segments, dtype, layout, chunk):
    clip = make_clip(frames=7, height=75, width=100, dtype=dtype, layout=layout)
    source = file_source(segments, clip, layout, offset=4096 if dtype == torch.uint8 else 0)
    try:
        check(tmp_path, clip, layout=layout, chunk_bytes=chunk, source=source, fps=23.976)
    finally:
        source.close()


def test_default_threads_are_x264s_own_choice(tmp_path):
    clip = make_clip(height=75, width=100)
    result = Encoder().encode(TensorSource(clip), tmp_path / "a.mp4", EncodeParams(fps=24))
    assert result.threads == x264_auto_threads(75)


def test_input_not_modified(tmp_path):
    clip = make_clip(frames=3)
    before = clip.clone()
    Encoder(chunk_bytes=1).encode(TensorSource(clip), tmp_path / "a.mp4", EncodeParams(fps=24))
    assert torch.equal(clip, before)


def test_overwrites_existing_file_atomically(tmp_path):
    out = tmp_path / "a.mp4"
    out.write_bytes(b"old")
    clip = make_clip(frames=3)
    result = Encoder().encode(TensorSource(clip), out, EncodeParams(fps=24))
    assert sha256(out) == result.sha256 == reference_mp4(clip, tmp_path / "ref.mp4")
    assert out.read_bytes()[:3] != b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.mp4", "ref.mp4"]


def test_a_spooled_output_is_not_fsynced(tmp_path, monkeypatch):
    """A file is fsynced, and so is its directory after the rename; a spooled output
    (memory, object: read back at once, worthless after a crash) is neither, and its
    bytes are the same."""
    from framewire.service import _outputs

    synced: list[str] = []
    real = _outputs.os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(_outputs.os, "fsync", fsync)
    clip = make_clip(frames=3)
    kept = Encoder().encode(TensorSource(clip), tmp_path / "a.mp4", EncodeParams(fps=24))
    assert [Path(p).name for p in synced] == ["a.mp4", tmp_path.name]
    synced.clear()
    spooled = Encoder().encode(
        TensorSource(clip), tmp_path / "b.mp4", EncodeParams(fps=24), durable=False
    )
    assert synced == [] and spooled.sha256 == kept.sha256 == sha256(tmp_path / "b.mp4")


def test_the_output_is_hashed_while_it_is_inspected(tmp_path, monkeypatch):
    """The sha256 runs on a thread of its own beside the inspection (validation), not
    after it; an output the inspection refuses is refused, and one the hash could not read
    back is answered as that (what was raised when the hash came first), nothing left."""
    from framewire.core.errors import Conflict, MediaError
    from framewire.service import _outputs

    clip = make_clip(frames=3)
    inspecting, digested = threading.Event(), threading.Event()
    seen: list[bool] = []
    real = _outputs.TempOutput.digest

    def digest(self: _outputs.TempOutput) -> tuple[int, str]:
        seen.append(inspecting.wait(5))  # one after the other, this waits in vain
        try:
            return real(self)
        finally:
            digested.set()

    def inspect(path: str) -> None:
        inspecting.set()
        seen.append(digested.wait(5))

    monkeypatch.setattr(_outputs.TempOutput, "digest", digest)
    params = EncodeParams(fps=24)
    result = Encoder().encode(TensorSource(clip), tmp_path / "a.mp4", params, inspect=inspect)
    assert seen == [True, True] and result.sha256 == sha256(tmp_path / "a.mp4")

    def refuse(path: str) -> None:
        raise MediaError("not what was asked", code="validation_failed")

    with pytest.raises(MediaError):
        Encoder().encode(TensorSource(clip), tmp_path / "b.mp4", params, inspect=refuse)

    def unreadable(self: object) -> tuple[int, str]:
        raise _outputs.changed("cannot read back the output")

    monkeypatch.setattr(_outputs.TempOutput, "digest", unreadable)
    with pytest.raises(Conflict):
        Encoder().encode(TensorSource(clip), tmp_path / "b.mp4", params, inspect=refuse)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.mp4"]


def test_parallel_encodes_do_not_share_buffers(tmp_path):
    """Concurrent jobs each own their staging: outputs stay byte-exact."""
    from concurrent.futures import ThreadPoolExecutor

    clips = [make_clip(frames=9, height=75, width=100, seed=s) for s in range(3)]
    enc = Encoder(chunk_bytes=1, fallback=False)

    def one(i: int):
        return enc.encode(TensorSource(clips[i]), tmp_path / f"{i}.mp4", EncodeParams(fps=24))

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(one, range(3)))
    for i, r in enumerate(results):
        assert r.sha256 == reference_mp4(clips[i], tmp_path / f"ref{i}.mp4")


def test_wire_dtype_table():
    assert {d.value for d in DType} == {"float32", "float16", "bfloat16", "uint8"}
    assert np.dtype("float16").itemsize == DType.float16.itemsize


@pytest.mark.parametrize("block_bytes", [1000, 5000, 200_000])
@pytest.mark.parametrize(
    ("dtype", "layout"),
    [
        (torch.float32, Layout.CTHW),
        (torch.float16, Layout.TCHW),
        (torch.bfloat16, Layout.THWC),
        (torch.uint8, Layout.CTHW),
    ],
)
@pytest.mark.parametrize("from_shm", [False, True])
def test_row_blocks(tmp_path, segments, monkeypatch, block_bytes, dtype, layout, from_shm):
    """Conversion blocks smaller than a frame (rows of one frame) or spanning several."""
    from framewire.service._encode import pump as stream

    monkeypatch.setattr(stream, "BLOCK_BYTES", block_bytes)
    clip = make_clip(frames=5, height=75, width=100, dtype=dtype, layout=layout)
    source = file_source(segments, clip, layout) if from_shm else TensorSource(clip, layout)
    try:
        check(tmp_path, clip, layout=layout, source=source, chunk_bytes=1 << 20, fps=24)
    finally:
        source.close()


def test_uint8_thwc_segment_is_sent_without_conversion(tmp_path, segments, monkeypatch):
    """Contiguous uint8 THWC bytes go from the segment's fd to ffmpeg: no staging, no copy."""
    from framewire.service._encode import encoder

    def no_pump(*args, **kw):
        raise AssertionError("the conversion pump ran for zero-copy input")

    monkeypatch.setattr(encoder, "Pump", no_pump)
    clip = make_clip(frames=6, height=75, width=100, dtype=torch.uint8, layout=Layout.THWC)
    source = file_source(segments, clip, Layout.THWC, offset=8192)
    try:
        check(tmp_path, clip, layout=Layout.THWC, source=source, fps=24)
    finally:
        source.close()


@pytest.mark.parametrize("route", ["pump", "zero copy"])
def test_progress_hears_each_piece_fed_to_ffmpeg(tmp_path, segments, route):
    """``progress`` is told the frames sent after each piece, in order, up to the last; the
    bytes are the same as without it."""
    if route == "pump":
        clip, layout = make_clip(frames=7), Layout.CTHW
        source = TensorSource(clip, layout)
    else:
        clip, layout = make_clip(frames=7, dtype=torch.uint8, layout=Layout.THWC), Layout.THWC
        source = file_source(segments, clip, layout)
    seen: list[int] = []
    out = tmp_path / "out.mp4"
    try:
        result = Encoder(chunk_bytes=1, fallback=False).encode(
            source, out, EncodeParams(fps=24), progress=seen.append
        )
    finally:
        source.close()
    assert seen == [1, 2, 3, 4, 5, 6, 7]  # a budget of one byte: one frame a piece
    assert result.sha256 == sha256(out) == reference_mp4(clip, tmp_path / "ref.mp4", layout=layout)
