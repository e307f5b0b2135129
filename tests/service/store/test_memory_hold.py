"""A memory output encoded straight into its memfd (service/_store/handoff.py
``MemoryHold``): no file is written for it anywhere, its bytes are those the same encode
writes to a file, the hold seals that memfd itself, and a memfd not taken goes with its
output."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import threading
from pathlib import Path

import av
import pytest
from framewire.core.errors import Cancelled, Overloaded
from framewire.core.wire import OutputResult
from framewire.service._encode.encoder import EncodeParams, Encoder
from framewire.service._settings import Settings
from framewire.service._sources.frames import TensorSource
from framewire.service._store.handoff import MemoryTarget
from framewire.service._store.memfile import MemoryHold
from framewire.service._store.uploads import Uploads

from tests.support.media import make_clip, sha256
from tests.support.processes import open_memfds

TARGET = MemoryTarget("a.mp4", uid=os.getuid())
HELD = "framewire-output:"


def _read(fd: int) -> bytes:
    return os.pread(fd, os.fstat(fd).st_size, 0)


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if not p.is_dir()]


@pytest.mark.parametrize(
    ("name", "profile"),
    [
        ("a.mp4", "imageio"),
        ("a.m4v", "imageio"),
        ("a.mov", "imageio"),
        ("a.mkv", "imageio"),  # Matroska's segment UID is random: its muxer is checked
        ("a.mp4", "vllm-omni"),  # the PyAV child, given the memfd as a spare's job
    ],
)
def test_the_encode_writes_the_memfd_with_a_files_bytes(tmp_path, name, profile):
    """The memfd's name has no extension: the muxer is named instead (ffmpeg's ``-f``),
    and it writes the bytes the file's extension would have picked."""
    clip = make_clip(frames=3)
    params = EncodeParams(fps=24, profile=profile)
    encoder = Encoder()
    (tmp_path / "file").mkdir()
    on_disk = encoder.encode(TensorSource(clip), tmp_path / "file" / name, params)
    spool = tmp_path / "spool"
    spool.mkdir()
    hold = MemoryHold(MemoryTarget(name, uid=os.getuid()))
    try:
        encoded = encoder.encode(
            TensorSource(clip), spool / name, params, follower=hold, durable=False
        )
        assert _files(spool) == [], "a memory output wrote a file"
        fd = hold.taken(encoded.bytes)
        assert fd is not None and hold.taken(encoded.bytes) is None  # taken once
        try:
            data = _read(fd)
        finally:
            os.close(fd)
    finally:
        hold.close()
        encoder.close()
    assert hashlib.sha256(data).hexdigest() == encoded.sha256
    if name.endswith(".mkv"):
        with av.open(io.BytesIO(data)) as container:
            assert "matroska" in container.format.name
        assert data[:4] == b"\x1a\x45\xdf\xa3"  # EBML, as the file's
        assert (tmp_path / "file" / name).read_bytes()[:4] == data[:4]
        return
    assert encoded.sha256 == on_disk.sha256 == sha256(tmp_path / "file" / name)


def test_a_memfd_not_taken_goes_with_its_output():
    before = open_memfds(HELD)
    hold = MemoryHold(TARGET)
    assert open_memfds(HELD) == before + 1
    hold.close()
    assert open_memfds(HELD) == before
    hold.close()  # idempotent
    with pytest.raises(Cancelled):
        hold.destination()  # the output ended (a cancel) before its encode began
    hold = MemoryHold(TARGET)
    destination = hold.destination()
    assert destination is not None
    os.pwrite(destination.fd, b"y" * 100, 0)
    assert hold.taken(99) is None  # not the digest's size: not handed over, and closed
    assert open_memfds(HELD) == before


def _deliver(uploads: Uploads, spool: Path, hold: MemoryHold, size: int) -> OutputResult:
    result = OutputResult(path="spooled.mp4", ok=True, bytes=size, sha256="0" * 64)
    fd = os.open(spool, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return asyncio.run(
            uploads.deliver(result, fd, "spooled.mp4", TARGET, None, threading.Event(), hold)
        )
    finally:
        os.close(fd)


def _written(data: bytes) -> MemoryHold:
    hold = MemoryHold(TARGET)
    destination = hold.destination()
    assert destination is not None
    os.pwrite(destination.fd, data, 0)
    return hold


def test_the_hold_seals_the_memfd_written(tmp_path):
    data = os.urandom(70_000)
    spool = tmp_path / "spool"
    spool.mkdir()
    uploads = Uploads(Settings(output_roots=[str(tmp_path)]))
    try:
        hold = _written(data)
        destination = hold.destination()
        assert destination is not None
        written = os.fstat(destination.fd).st_ino
        result = _deliver(uploads, spool, hold, len(data))
        assert result.url == "memory://a.mp4" and result.handoff is not None
        fd, size = uploads.handoffs.take(result.handoff, os.getuid())
        try:
            assert os.fstat(fd).st_ino == written, "the hold copied the memfd"
            assert size == len(data) and _read(fd) == data
        finally:
            os.close(fd)
        hold.close()  # nothing left to close: the hold took it
    finally:
        uploads.handoffs.close()


def test_a_refused_hold_closes_the_memfd(tmp_path):
    """Past the bound on held bytes the hold is refused (429) and its memfd goes."""
    data = b"v" * 70_000
    spool = tmp_path / "spool"
    spool.mkdir()
    uploads = Uploads(Settings(output_roots=[str(tmp_path)], held_output_bytes=65536))
    before = open_memfds(HELD)
    hold = _written(data)
    try:
        with pytest.raises(Overloaded) as refused:
            _deliver(uploads, spool, hold, len(data))
        assert refused.value.code == "handoffs_full"
        assert open_memfds(HELD) == before
    finally:
        hold.close()
        uploads.handoffs.close()
