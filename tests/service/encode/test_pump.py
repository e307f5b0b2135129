"""The sendfile pump: page reuse, partial writes, EAGAIN, early exit."""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import time

import numpy as np
import pytest
import torch
from framewire.client.wire import Layout
from framewire.core.errors import BadRequest
from framewire.core.media import pipe as pipe_module
from framewire.core.media.pipe import FfmpegExited, PipeWriter
from framewire.service._convert import kernels, staging
from framewire.service._convert.staging import ChunkWriter, Staging
from framewire.service._encode import pump as stream
from framewire.service._encode.pump import HostWriter, pump_converted
from framewire.service._sources.frames import TensorSource

from tests.support.media import make_clip, reference_uint8


def drain_later(
    fd: int, delay: float, out: bytearray, reading: threading.Event | None = None
) -> threading.Thread:
    """A thread that reads ``fd`` to its end after ``delay`` (``reading`` set then)."""

    def run() -> None:
        time.sleep(delay)
        if reading is not None:
            reading.set()
        while block := os.read(fd, 1 << 16):
            out.extend(block)

    t = threading.Thread(target=run)
    t.start()
    return t


def pump_through_slow_pipe(clip: torch.Tensor, writer: ChunkWriter | None = None) -> bytes:
    r, w = os.pipe()
    got = bytearray()
    reader = drain_later(r, 0.3, got)
    try:
        pump_converted(TensorSource(clip), PipeWriter(w), per_chunk=1, writer=writer)
    finally:
        os.close(w)
        reader.join()
        os.close(r)
    return bytes(got)


def sendfile_shares_pages() -> bool:
    """Whether a page sent into a pipe with sendfile is still the file's page until read
    (the kernel splices it): written over after the send, the reader sees the new bytes.
    The hazard the tests below show exists only where it is."""
    fd = os.memfd_create("framewire-probe")
    r, w = os.pipe()
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        with mmap.mmap(fd, mmap.PAGESIZE) as page:
            page[:] = b"a" * mmap.PAGESIZE
            os.sendfile(w, fd, 0, mmap.PAGESIZE)
            page[:] = b"b" * mmap.PAGESIZE
        return os.read(r, 1) == b"b"
    finally:
        for end in (fd, r, w):
            os.close(end)


def test_slots_are_not_rewritten_under_the_pipe():
    """Many chunks sit in the pipe unread while both slots are reused."""
    clip = make_clip(frames=40, height=48, width=64)
    assert pump_through_slow_pipe(clip) == reference_uint8(clip, Layout.CTHW).tobytes()


def test_without_punching_slots_the_pipe_sees_rewritten_pages(monkeypatch):
    """Shows why Staging punches slots: reuse without it corrupts what ffmpeg reads."""

    def slot_without_punch(self: Staging, index: int, nbytes: int) -> torch.Tensor:
        start = index * self.slot_bytes
        return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=start)

    monkeypatch.setattr(staging.Staging, "slot", slot_without_punch)
    if not sendfile_shares_pages():
        pytest.skip("this kernel copies on sendfile into a pipe; the hazard cannot show here")
    clip = make_clip(frames=40, height=48, width=64)
    assert pump_through_slow_pipe(clip) != reference_uint8(clip, Layout.CTHW).tobytes()


class PinnedHostWriter(HostWriter):
    """The host converter declaring its staging page-locked, as the GPU writer does when
    cudaHostRegister succeeds: its slots must then never be punched."""

    def open(self, staging: Staging | None, frames: int) -> None:
        self.pinned = True


def test_pinned_slots_are_reused_only_once_the_pipe_drained(monkeypatch):
    punches: list[bool] = []
    real_slot = Staging.slot

    def slot(self: Staging, index: int, nbytes: int, *, punch: bool = True) -> torch.Tensor:
        punches.append(punch)
        return real_slot(self, index, nbytes, punch=punch)

    monkeypatch.setattr(staging.Staging, "slot", slot)
    clip = make_clip(frames=40, height=48, width=64)
    got = pump_through_slow_pipe(clip, PinnedHostWriter(TensorSource(clip)))
    assert got == reference_uint8(clip, Layout.CTHW).tobytes()
    assert len(punches) == 40 and not any(punches)


def test_pinned_slots_without_the_drain_wait_would_be_overwritten(monkeypatch):
    """Shows why pinned slots wait: not punched and not waited for, they corrupt."""
    monkeypatch.setattr(stream.PipeDrain, "wait", lambda self, slot: None)
    if not sendfile_shares_pages():
        pytest.skip("this kernel copies on sendfile into a pipe; the hazard cannot show here")
    clip = make_clip(frames=40, height=48, width=64)
    got = pump_through_slow_pipe(clip, PinnedHostWriter(TensorSource(clip)))
    assert got != reference_uint8(clip, Layout.CTHW).tobytes()


def test_pinned_pump_stops_when_the_reader_goes_away():
    r, w = os.pipe()
    pipe = PipeWriter(w)

    def read_a_little_then_close() -> None:
        os.read(r, 4096)
        time.sleep(0.2)
        os.close(r)

    reader = threading.Thread(target=read_a_little_then_close)
    reader.start()
    clip = make_clip(frames=60, height=96, width=128)
    started = time.monotonic()
    try:
        with pytest.raises(FfmpegExited):
            pump_converted(
                TensorSource(clip), pipe, per_chunk=1, writer=PinnedHostWriter(TensorSource(clip))
            )
    finally:
        reader.join()
        os.close(w)
    assert time.monotonic() - started < 10


def test_send_file_handles_nonblocking_pipe_and_partial_writes():
    data = np.random.default_rng(1).integers(0, 255, 3 << 20, dtype=np.uint8).tobytes()
    src = os.memfd_create("framewire-test-src")
    os.write(src, data)
    r, w = os.pipe()
    pipe = PipeWriter(w)
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 16)  # partial writes: 3 MiB through 64 KiB
    got = bytearray()
    reader = drain_later(r, 0.05, got)
    try:
        pipe.send_file(src, 0, len(data))
    finally:
        os.close(w)
        reader.join()
        os.close(r)
        os.close(src)
    assert bytes(got) == data


def test_send_file_reports_reader_gone_and_short_source():
    src = os.memfd_create("framewire-test-src")
    os.write(src, b"x" * 1000)
    r, w = os.pipe()
    os.close(r)
    with pytest.raises(FfmpegExited):
        PipeWriter(w).send_file(src, 0, 1000)
    os.close(w)
    r, w = os.pipe()
    with pytest.raises(BadRequest) as err:
        PipeWriter(w).send_file(src, 0, 2000)
    assert err.value.code == "segment_truncated"
    for fd in (r, w, src):
        os.close(fd)


def test_staging_slots_are_page_aligned_and_released():
    with Staging(1000) as s:
        assert s.slot_bytes % os.sysconf("SC_PAGE_SIZE") == 0
        view = s.slot(1, 1000)
        view.fill_(7)
        del view
        fd = s.fd
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_pump_with_slots_ahead_returns_before_the_reader_reads():
    """Ten slots of one frame (two, and eight ahead): a 6-frame source is all converted
    while nobody reads the pipe (its 64 KiB hold one frame), and the bytes come out in
    order once read."""
    clip = make_clip(frames=6, height=128, width=128)  # 48 KiB a frame
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 16)
    got = bytearray()
    try:
        with stream.Pump(
            PipeWriter(w), 128, 128, per_chunk=1, ahead_bytes=8 * 3 * 128 * 128
        ) as pump:
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 16)  # PipeWriter raised it to 1 MiB
            started = time.monotonic()
            assert pump.send(TensorSource(clip), wait=False) == 6 * 3 * 128 * 128
            assert time.monotonic() - started < 5 and stream.pipe_unread(w) <= 1 << 16
            reader = drain_later(r, 0, got)
            pump.flush()
    finally:
        os.close(w)
        reader.join()
        os.close(r)
    assert bytes(got) == reference_uint8(clip, Layout.CTHW).tobytes()


def test_a_send_that_fails_after_the_source_went_ahead_is_raised_by_the_next_call():
    clip = make_clip(frames=6, height=128, width=128)
    r, w = os.pipe()
    try:
        with stream.Pump(
            PipeWriter(w), 128, 128, per_chunk=1, ahead_bytes=8 * 3 * 128 * 128
        ) as pump:
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 16)
            pump.send(TensorSource(clip), wait=False)
            os.close(r)  # ffmpeg dies with frames still to send
            r = -1
            with pytest.raises(FfmpegExited):
                pump.flush()
            with pytest.raises(FfmpegExited):  # and again: the pump is spent
                pump.send(TensorSource(clip))
    finally:
        os.close(w)
        if r >= 0:
            os.close(r)


def test_slots_followed_by_a_pipe_full_of_sends_are_rewritten_without_punching(monkeypatch):
    """Eight 48 KiB slots through a 64 KiB pipe its reader empties late: a slot whose last
    send was followed by a pipe's capacity of completed sends is rewritten as it is (no
    page to fault in again), one followed by less is punched, and the reader gets every
    frame as it was."""
    if not sendfile_shares_pages():
        pytest.skip("this kernel copies on sendfile into a pipe; the hazard cannot show here")
    asked: list[bool] = []
    real = Staging.pipe_may_hold
    reading = threading.Event()

    def pipe_may_hold(self: Staging, index: int) -> bool:
        if reading.is_set():
            # Once the reader reads, a converter slower than the pipe: the sends queued
            # behind this slot's complete first (on a loaded host the converter could
            # otherwise keep right behind the sender, no slot ever followed by a pipe's
            # capacity of completed sends).
            time.sleep(0.02)
        asked.append(real(self, index))
        return asked[-1]

    monkeypatch.setattr(Staging, "pipe_may_hold", pipe_may_hold)
    kernels.warm()  # the slots filled before the reader reads, not while a kernel loads
    clip = make_clip(frames=40, height=128, width=128)  # 48 KiB a frame
    r, w = os.pipe()
    got = bytearray()
    reader = drain_later(r, 0.3, got, reading)
    try:
        with stream.Pump(PipeWriter(w), 128, 128, per_chunk=1, ahead_bytes=6 * 3 * 128 * 128) as p:
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 16)  # PipeWriter raised it to 1 MiB
            p.staging.in_flight = 1 << 16
            p.send(TensorSource(clip))
    finally:
        os.close(w)
        reader.join()
        os.close(r)
    assert bytes(got) == reference_uint8(clip, Layout.CTHW).tobytes()
    assert False in asked and True in asked


def test_bytes_sent_as_they_lie_return_once_read_and_say_a_reader_gone():
    """``send_uncopied``: a producer's pages go into the pipe by reference, so the call
    returns only once the reader consumed them all (here: not while 1 KiB is unread);
    a reader that goes away instead ends the wait with FfmpegExited."""
    fd = os.memfd_create("framewire-test-uncopied")
    os.write(fd, bytes(range(256)) * 256)  # 64 KiB: the pipe holds them whole
    try:
        for reader_leaves in (False, True):
            r, w = os.pipe()
            pipe = PipeWriter(w)
            done: list[BaseException | None] = []

            def send(pipe: PipeWriter = pipe, done: list[BaseException | None] = done) -> None:
                with stream.Pump(pipe, 16, 16, per_chunk=1) as pump:
                    try:
                        pump.send_uncopied(fd, 0, 64 << 10, lambda: None)
                        done.append(None)
                    except BaseException as exc:
                        done.append(exc)

            sender = threading.Thread(target=send)
            sender.start()
            got = bytearray()
            while len(got) < (63 << 10):
                got += os.read(r, (63 << 10) - len(got))
            time.sleep(0.3)
            assert done == [], "returned while the reader had not read every byte"
            if reader_leaves:
                os.close(r)
            else:
                got += os.read(r, 1 << 10)
            sender.join(10)
            assert not sender.is_alive()
            os.close(w)
            if reader_leaves:
                assert isinstance(done[0], FfmpegExited)
            else:
                os.close(r)
                assert done == [None] and bytes(got) == bytes(range(256)) * 256
    finally:
        os.close(fd)


def test_a_wait_for_the_reader_looks_soon_then_less_often(monkeypatch):
    """A chunk's answer waits until its bytes are read: the wait looks at the pipe after
    READ_POLL_FIRST_S, then twice as long each time up to READ_POLL_S (a reader at its
    pipe has taken a small chunk by the first look), and returns at the look that finds
    the pipe read."""
    slept: list[float] = []
    r, w = os.pipe()
    os.write(w, b"x" * 100)

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 6:
            os.read(r, 100)

    monkeypatch.setattr(pipe_module.time, "sleep", sleep)
    try:
        PipeWriter(w).wait_read()
    finally:
        os.close(r)
        os.close(w)
    first, most = pipe_module.READ_POLL_FIRST_S, pipe_module.READ_POLL_S
    assert slept == [first, 2 * first, 4 * first, 8 * first, most, most]
