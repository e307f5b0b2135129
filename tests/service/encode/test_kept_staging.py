"""Staging memfds kept between encodes: reused with their pages, never under a pipe that
may still read them, bounded in bytes and in time, and every encode's bytes unchanged."""

from __future__ import annotations

import mmap
import os
import threading
import time

import pytest
import torch
from framewire.client.wire import Layout
from framewire.core.media.pipe import PipeWriter
from framewire.service._convert.kept import KeptStaging
from framewire.service._convert.staging import REFUSED, Staging
from framewire.service._encode.pump import Pump
from framewire.service._sources.frames import TensorSource

from tests.service.encode.test_pump import drain_later, sendfile_shares_pages
from tests.support.media import make_clip, reference_uint8

PAGE = mmap.PAGESIZE


def resident_pages(fd: int, size: int) -> int:
    """Pages of the memfd that hold data (not holes)."""
    pages, offset = 0, 0
    while offset < size:
        try:
            data = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError:
            break
        hole = os.lseek(fd, data, os.SEEK_HOLE)
        pages += (min(hole, size) - data) // PAGE
        offset = hole
    return pages


def test_a_staging_let_go_is_taken_again_with_its_pages():
    """Two slots of 16 pages, each sent into a pipe of 2 pages' capacity: kept with 13
    pages each (the 3 the pipe may hold punched out)."""
    kept = KeptStaging(64 << 20)
    try:
        with Staging(16 * PAGE, 2, in_flight=2 * PAGE, kept=kept) as first:
            first.slot(0, 16 * PAGE).fill_(1)
            first.slot(1, 16 * PAGE).fill_(2)
            inode = os.fstat(first.fd).st_ino
        assert kept.kept_bytes == 32 * PAGE
        with Staging(16 * PAGE, 2, kept=kept) as second:
            assert os.fstat(second.fd).st_ino == inode
            assert resident_pages(second.fd, second.size) == 26  # no fresh page to fault in
            assert kept.kept_bytes == 0  # taken: no other encode may get it meanwhile
        with Staging(64 * PAGE, 2, kept=kept) as larger:
            assert os.fstat(larger.fd).st_ino != inode  # too small for it
    finally:
        kept.close()
    assert kept.kept_bytes == 0


def test_what_the_pipe_may_still_hold_is_punched_before_it_is_kept():
    """Slot 0 sent 10 pages into a pipe of 2 pages' capacity: the last 3 pages (the
    capacity and a page) are holes once kept, the other 7 kept."""
    kept = KeptStaging(64 << 20)
    try:
        with Staging(10 * PAGE, 1, in_flight=2 * PAGE, kept=kept) as s:
            s.slot(0, 10 * PAGE).fill_(9)
            fd = s.fd
            assert resident_pages(fd, s.size) == 10
        assert resident_pages(fd, 10 * PAGE) == 7
    finally:
        kept.close()


def test_a_kept_staging_never_changes_what_an_earlier_pipe_reads():
    """The hazard keeping brings: an encode's pipe still holds pages of its staging (its
    reader has not read them) when the staging goes to the next encode, which writes
    other frames into it. The first reader must still read its own frames."""
    if not sendfile_shares_pages():
        pytest.skip("this kernel copies on sendfile into a pipe; the hazard cannot show here")
    kept = KeptStaging(64 << 20)
    first, second = make_clip(frames=4, height=48, width=64, seed=1), make_clip(4, 48, 64, seed=2)
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    got1, got2 = bytearray(), bytearray()
    try:
        with Pump(PipeWriter(w1), 48, 64, per_chunk=4, kept=kept) as pump:
            pump.send(TensorSource(first))  # 36 KiB: all of it in the pipe, unread
        with Pump(PipeWriter(w2), 48, 64, per_chunk=4, kept=kept) as pump:
            reader2 = drain_later(r2, 0, got2)
            pump.send(TensorSource(second))
        os.close(w2)
        reader2.join()
        os.close(w1)
        reader1 = drain_later(r1, 0, got1)
        reader1.join()
    finally:
        kept.close()
        for fd in (r1, r2):
            os.close(fd)
    assert bytes(got1) == reference_uint8(first, Layout.CTHW).tobytes()
    assert bytes(got2) == reference_uint8(second, Layout.CTHW).tobytes()


def test_at_most_keep_bytes_are_kept_the_oldest_let_go_first():
    kept = KeptStaging(48 * PAGE)
    try:
        stagings = [Staging(8 * PAGE, 2, kept=kept) for _ in range(4)]  # 16 pages each
        inodes = [os.fstat(s.fd).st_ino for s in stagings]
        for s in stagings:
            s.close()
        assert kept.kept_bytes == 48 * PAGE
        taken = [Staging(8 * PAGE, 2, kept=kept) for _ in range(3)]
        assert {os.fstat(s.fd).st_ino for s in taken} == set(inodes[1:])  # the first went
        for s in taken:
            s.close()
        with Staging(64 * PAGE, 1, kept=kept):
            pass  # larger than everything kept may be: not kept
        assert kept.kept_bytes == 48 * PAGE
    finally:
        kept.close()


def test_nothing_is_kept_past_the_idle_time():
    kept = KeptStaging(64 << 20, idle_s=0.2)
    try:
        with Staging(16 * PAGE, 2, kept=kept):
            pass
        assert kept.kept_bytes == 32 * PAGE
        deadline = time.monotonic() + 10
        while kept.kept_bytes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kept.kept_bytes == 0
        with Staging(16 * PAGE, 2, kept=kept):
            pass  # kept again after the sweeper ended: a new one starts
        assert kept.kept_bytes == 32 * PAGE
        deadline = time.monotonic() + 10
        while kept.kept_bytes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kept.kept_bytes == 0
        # Counted out under its lock, the memfds are closed just after, on the sweeper's
        # thread, which then ends: waited for, or the leak check could run in between.
        while sweeping() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not sweeping()
    finally:
        kept.close()


def sweeping() -> bool:
    return any(t.name == "framewire-staging" for t in threading.enumerate())


def test_a_page_locked_staging_is_not_kept():
    kept = KeptStaging(64 << 20)
    try:
        with Staging(16 * PAGE, 2, kept=kept) as locked:
            locked.pinned_on = torch.device("cuda", 0)  # as cudaHostRegister leaves it
            fd = locked.fd
        assert kept.kept_bytes == 0
        with pytest.raises(OSError):
            os.fstat(fd)
        with Staging(16 * PAGE, 2, kept=kept) as refused:
            refused.pinned_on = REFUSED  # the driver would not lock it: plain pages
        assert kept.kept_bytes == 32 * PAGE
    finally:
        kept.close()


def test_framewire_memfds_counts_each_memfd_once_however_many_fds_it_has():
    """A mapped memfd has two descriptors (its own, and the mapping's); a kept staging
    is one memfd, and so is a dup of one."""
    from framewire.service._ops.metrics import memfds_open

    before = memfds_open()
    kept = KeptStaging(64 << 20)
    try:
        with Staging(16 * PAGE, 2, kept=kept) as s:
            extra = os.dup(s.fd)
            try:
                assert memfds_open() == before + 1
            finally:
                os.close(extra)
        assert memfds_open() == before + 1  # kept
    finally:
        kept.close()
    assert memfds_open() == before
