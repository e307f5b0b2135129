"""Descriptors of unusual memory on the fd socket: huge pages, pages never written."""

from __future__ import annotations

import fcntl
import os

import pytest
import torch
from framewire.client.wire import Layout

from tests.service.fdsocket.test_regions import SEALS, encode, region_source, register
from tests.support.media import make_clip, reference_mp4
from tests.support.refclips import RawConnection
from tests.support.requests import Baseline, settle
from tests.support.segments import raw_bytes

PAGE = os.sysconf("SC_PAGE_SIZE")


def sealed_memfd(size: int, data: bytes = b"", flags: int = 0) -> int:
    """A memfd of ``size`` bytes, ``data`` written at its start and the rest never written."""
    fd = os.memfd_create("test-frames", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | flags)
    os.ftruncate(fd, size)
    if data:
        os.pwrite(fd, data, 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def test_a_sealed_huge_page_memfd_is_bad_fd_and_the_worker_serves_on(worker, tmp_path):
    baseline = Baseline.of(worker)
    huge = 2 << 20
    try:
        fd = sealed_memfd(huge, flags=os.MFD_HUGETLB)
    except OSError as exc:  # no hugetlbfs in this kernel
        pytest.fail(f"memfd_create(MFD_HUGETLB): {exc}")
    clip = make_clip(frames=2, height=32, width=32)
    with RawConnection(worker.fd_socket) as conn:
        header = register(conn, "huge", fd, len(raw_bytes(clip)))
        assert (header["ok"], header["code"], header["reason"]) == (False, "bad_request", "bad_fd")
        assert "MFD_HUGETLB" in header["message"], header
        # The same connection and the worker go on.
        plain = sealed_memfd(len(raw_bytes(clip)), raw_bytes(clip))
        assert register(conn, "plain", plain, len(raw_bytes(clip)))["ok"] is True
        status, body = encode(worker, region_source("plain", clip), "after-huge.mp4")
        assert status == 200, body
        assert body["outputs"][0]["sha256"] == reference_mp4(clip, tmp_path / "ref.mp4")
    os.close(fd), os.close(plain)
    (worker.outputs / "after-huge.mp4").unlink()
    settle(worker, baseline)


@pytest.mark.parametrize(
    ("dtype", "layout"),
    [
        (torch.float32, Layout.CTHW),  # converted from the mapping
        (torch.uint8, Layout.THWC),  # sent to ffmpeg from the descriptor
    ],
)
@pytest.mark.parametrize("written", [0.0, 0.5])
def test_pages_never_written_are_not_allocated_by_the_worker(
    worker, tmp_path, dtype, layout, written
):
    """A sealed memfd whose pages were (partly) never written reads as zeros there, and
    the worker's reads allocate none of them (the memfd's block count stays put)."""
    clip = make_clip(frames=24, height=64, width=96, dtype=dtype, layout=layout)
    data = raw_bytes(clip)
    head = int(len(data) * written) // PAGE * PAGE
    fd = sealed_memfd(len(data), data[:head])
    blocks = os.fstat(fd).st_blocks
    expected = bytearray(len(data))
    expected[:head] = data[:head]
    seen = torch.frombuffer(expected, dtype=dtype).reshape(clip.shape)
    with RawConnection(worker.fd_socket) as conn:
        assert register(conn, "holes", fd, len(data))["sealed"] is True
        status, body = encode(worker, region_source("holes", clip, layout.value), "holes.mp4")
        assert status == 200, body
    assert body["outputs"][0]["sha256"] == reference_mp4(seen, tmp_path / "ref.mp4", layout=layout)
    assert os.fstat(fd).st_blocks == blocks, "the worker allocated pages never written"
    os.close(fd)
    (worker.outputs / "holes.mp4").unlink()
