"""Sources: shm opening rules, size checks, .npy files."""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest
import torch
from framewire.client.wire import DType, Layout
from framewire.core.errors import BadRequest, Forbidden, NotFound
from framewire.service._sources.frames import FileSource, Geometry, TensorSource, open_npy
from framewire.service._sources.shm import open_shm

from tests.support.media import make_clip
from tests.support.segments import Segments


@pytest.fixture
def segment(segments: Segments) -> str:
    return segments.write(b"\x01" * 4096)


def test_open_shm_is_read_only(segment):
    fd = open_shm(segment, ["/framewire-test-"])
    try:
        with pytest.raises(OSError):
            os.write(fd, b"x")
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("key", "exc", "code"),
    [
        ("/other-name", Forbidden, "shm_prefix"),
        ("/framewire-test-missing", NotFound, "shm_not_found"),
        ("no-slash", BadRequest, "bad_shm_key"),
        ("/framewire-test-a/../../etc/passwd", BadRequest, "bad_shm_key"),
    ],
)
def test_open_shm_refusals(key, exc, code):
    with pytest.raises(exc) as err:
        open_shm(key, ["/framewire-test-"])
    assert err.value.code == code


def test_open_shm_refuses_symlinks(tmp_path):
    key = f"/framewire-test-{secrets.token_hex(6)}"
    target = tmp_path / "secret"
    target.write_bytes(b"x" * 100)
    os.symlink(target, f"/dev/shm{key}")
    try:
        with pytest.raises(Forbidden):
            open_shm(key, ["/framewire-test-"])
    finally:
        os.unlink(f"/dev/shm{key}")


def test_segment_smaller_than_descriptor(segment):
    fd = open_shm(segment, ["/framewire-test-"])
    geometry = Geometry(DType.float32, Layout.CTHW, 2, 16, 16)  # 6144 bytes > 4096
    with pytest.raises(BadRequest) as err:
        FileSource(fd, 0, geometry)
    os.close(fd)
    assert err.value.code == "segment_too_small"


def test_tensor_source_rejects_bad_shapes():
    with pytest.raises(BadRequest):
        TensorSource(torch.zeros(4, 2, 8, 8))
    with pytest.raises(BadRequest):
        TensorSource(torch.zeros(3, 8, 8))
    with pytest.raises(BadRequest):
        TensorSource(torch.zeros(3, 2, 8, 8, dtype=torch.float64))


@pytest.mark.parametrize("layout", list(Layout))
def test_npy_reads_what_numpy_wrote(tmp_path, layout):
    clip = make_clip(frames=5, layout=layout)
    path = tmp_path / "c.npy"
    np.save(path, clip.numpy())
    source = open_npy(path, layout)
    try:
        assert source.geometry.frames == 5
        got, owned = source.read(1, 4)
        assert owned
        want = clip[:, 1:4] if layout is Layout.CTHW else clip[1:4]
        assert torch.equal(got, want)
    finally:
        source.close()


def test_npy_refusals(tmp_path):
    path = tmp_path / "f.npy"
    np.save(path, np.asfortranarray(np.zeros((3, 2, 4, 4), np.float32)))
    with pytest.raises(BadRequest):
        open_npy(path)
    np.save(path, np.zeros((3, 2, 4, 4), np.float64))
    with pytest.raises(BadRequest) as err:
        open_npy(path)
    assert err.value.code == "bad_dtype"


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")
def test_a_hole_is_found_in_the_run_that_holds_it_and_nowhere_else():
    import mmap

    from framewire.service._sources.frames import _has_hole

    page = mmap.PAGESIZE
    fd = os.memfd_create("holes", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 64 * page)
        os.pwrite(fd, b"x" * (16 * page), 0)  # pages 0-15 written, 16-47 a hole,
        os.pwrite(fd, b"y" * (16 * page), 48 * page)  # 48-63 written
        with mmap.mmap(fd, 64 * page, prot=mmap.PROT_READ) as mapping:
            base = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
            assert not _has_hole(base, [(0, 16 * page)])
            assert not _has_hole(base, [(100, 10 * page), (48 * page + 5, 16 * page - 5)])
            assert _has_hole(base, [(0, 16 * page + 1)])  # one byte into the hole
            assert _has_hole(base, [(0, page), (20 * page, page)])
            assert os.fstat(fd).st_blocks * 512 == 32 * page  # looking allocated nothing
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["mapped", "file"])
def test_rgb24_frames_are_read_into_staging_by_pread_never_through_a_mapping(kind):
    """uint8 THWC frames in a memfd (a rank's region) or a segment: copied into the
    destination by one ``pread`` (the mapping's pages would each fault in, and be
    dropped after), holes read as zeros; a file cut short is refused; other dtypes or
    layouts are the converter's."""
    import mmap

    from framewire.service._encode.pump import HostWriter
    from framewire.service._sources.frames import MappedSource

    frames = np.random.default_rng(5).integers(0, 256, (5, 16, 24, 3), dtype=np.uint8)
    fd = os.memfd_create("test-frames")
    size = 4096 + frames.nbytes + 4096  # a hole of a page before the frames, none after
    os.ftruncate(fd, size)
    os.pwrite(fd, frames.tobytes()[: 3 * frames[0].nbytes], 4096)  # frames 3, 4 a hole
    mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    g = Geometry(DType.uint8, Layout.THWC, 5, 16, 24)
    try:
        source = (
            MappedSource(mapping, fd, 4096, g)
            if kind == "mapped"
            else FileSource(fd, 4096, g, owns_fd=False)
        )

        def no_read(*args: object) -> None:
            raise AssertionError("read through the mapping or a buffer")

        source.read = no_read  # type: ignore[method-assign]
        out = torch.full((5 * frames[0].nbytes,), 7, dtype=torch.uint8)
        HostWriter(source).write(lambda: out, 0, 5)
        hole = np.zeros(2 * frames[0].nbytes, np.uint8)
        expected = np.concatenate([frames[:3].reshape(-1), hole])
        assert (out.numpy() == expected).all()
        floats = Geometry(DType.float32, Layout.THWC, 1, 16, 24)
        assert FileSource(fd, 0, floats, owns_fd=False).read_into(0, 1, out) is False
        os.ftruncate(fd, 4096 + 2 * frames[0].nbytes)  # an unsealed one shrunk meanwhile
        with pytest.raises(BadRequest) as err:
            source.read_into(0, 5, out)
        assert err.value.code == "segment_truncated"
    finally:
        mapping.close()
        os.close(fd)
