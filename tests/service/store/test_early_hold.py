"""A memory output's bytes copied into its memfd beside the digest (service/_store/handoff.py
``EarlyHold``): the hold after the encode seals that copy instead of copying the spool file
again; a copy not taken goes with its output."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from pathlib import Path

import pytest
from framewire.core.errors import Overloaded
from framewire.core.wire import OutputResult
from framewire.service import _outputs
from framewire.service._encode.encoder import EncodeParams, Encoder
from framewire.service._settings import Settings
from framewire.service._sources.frames import TensorSource
from framewire.service._store import handoff
from framewire.service._store.handoff import EarlyHold, MemoryTarget
from framewire.service._store.uploads import Uploads

from tests.support.media import make_clip, sha256
from tests.support.processes import open_memfds

TARGET = MemoryTarget("a.mp4", uid=os.getuid())


def _read(fd: int) -> bytes:
    return os.pread(fd, os.fstat(fd).st_size, 0)


def test_the_copy_is_made_while_the_output_is_hashed(tmp_path, monkeypatch):
    """Each waits for the other: one after the other, they would time out."""
    copying, digested = threading.Event(), threading.Event()
    seen: list[bool] = []
    real_digest, real_written = _outputs.TempOutput.digest, EarlyHold.written

    def digest(self: _outputs.TempOutput) -> tuple[int, str]:
        seen.append(copying.wait(5))
        try:
            return real_digest(self)
        finally:
            digested.set()

    def written(self: EarlyHold, temp: _outputs.TempOutput) -> None:
        copying.set()
        seen.append(digested.wait(5))
        real_written(self, temp)

    monkeypatch.setattr(_outputs.TempOutput, "digest", digest)
    monkeypatch.setattr(EarlyHold, "written", written)
    early = EarlyHold(TARGET)
    clip = TensorSource(make_clip(frames=3))
    encoded = Encoder().encode(
        clip, tmp_path / "a.mp4", EncodeParams(fps=24), follower=early, durable=False
    )
    assert seen == [True, True]
    fd = early.taken(encoded.bytes)
    assert fd is not None and early.taken(encoded.bytes) is None  # taken once
    try:
        assert hashlib.sha256(_read(fd)).hexdigest() == encoded.sha256 == sha256(tmp_path / "a.mp4")
    finally:
        os.close(fd)
    early.close()


def _told(early: EarlyHold, tmp_path: Path, name: str, data: bytes) -> None:
    """Tell ``early`` that a file holding ``data`` is whole."""
    directory = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with _outputs.atomic_output(directory, name, durable=False) as temp:
            Path(temp.path).write_bytes(data)
            early.written(temp)
    finally:
        os.close(directory)


def _written(tmp_path: Path, data: bytes) -> EarlyHold:
    """An EarlyHold told that a file holding ``data`` is whole."""
    early = EarlyHold(TARGET)
    _told(early, tmp_path, "a.mp4", data)
    return early


def test_a_copy_not_taken_goes_with_its_output(tmp_path):
    before = open_memfds("framewire-output:")
    early = _written(tmp_path, b"x" * 5000)
    assert open_memfds("framewire-output:") == before + 1
    early.close()
    assert open_memfds("framewire-output:") == before
    early.close()  # idempotent
    early = _written(tmp_path, b"y" * 100)
    assert early.taken(99) is None  # not the digest's size: dropped, the hold copies again
    assert open_memfds("framewire-output:") == before
    late = EarlyHold(TARGET)
    late.close()  # the output ended before its file was whole (a cancel): nothing is kept
    _told(late, tmp_path, "b.mp4", b"z")
    assert late.taken(1) is None and open_memfds("framewire-output:") == before


def _deliver(uploads: Uploads, spool: Path, early: EarlyHold | None, size: int) -> OutputResult:
    result = OutputResult(path="spooled.mp4", ok=True, bytes=size, sha256="0" * 64)
    fd = os.open(spool, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return asyncio.run(
            uploads.deliver(result, fd, "spooled.mp4", TARGET, None, threading.Event(), early)
        )
    finally:
        os.close(fd)


def test_the_hold_keeps_the_copy_made_beside_the_digest(tmp_path, monkeypatch):
    data = os.urandom(70_000)
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "spooled.mp4").write_bytes(data)
    uploads = Uploads(Settings(output_roots=[str(tmp_path)]))
    copies: list[int] = []
    real = handoff.copied

    def counted(src: int, name: str) -> tuple[int, int]:
        copies.append(src)
        return real(src, name)

    monkeypatch.setattr(handoff, "copied", counted)
    try:
        early = _written(tmp_path, data)
        copies.clear()
        result = _deliver(uploads, spool, early, len(data))
        assert copies == [], "the spool file was copied again"
        assert result.url == "memory://a.mp4" and result.handoff is not None
        fd, size = uploads.handoffs.take(result.handoff, os.getuid())
        try:
            assert size == len(data) and _read(fd) == data
        finally:
            os.close(fd)
        assert not (spool / "spooled.mp4").exists()  # the spool file goes either way
        # No copy made (it failed, or the output is not one to hold early): copied now.
        (spool / "spooled.mp4").write_bytes(data)
        result = _deliver(uploads, spool, EarlyHold(TARGET), len(data))
        assert len(copies) == 1 and result.handoff is not None
        fd, _ = uploads.handoffs.take(result.handoff, os.getuid())
        os.close(fd)
    finally:
        uploads.handoffs.close()


def test_a_refused_hold_closes_the_copy(tmp_path):
    """Past the bound on held bytes the hold is refused (429) and its copy goes."""
    data = b"v" * 70_000
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "spooled.mp4").write_bytes(data)
    uploads = Uploads(Settings(output_roots=[str(tmp_path)], held_output_bytes=65536))
    before = open_memfds("framewire-output:")
    early = _written(tmp_path, data)
    try:
        with pytest.raises(Overloaded) as refused:
            _deliver(uploads, spool, early, len(data))
        assert refused.value.code == "handoffs_full"
        assert open_memfds("framewire-output:") == before and not (spool / "spooled.mp4").exists()
    finally:
        early.close()
        uploads.handoffs.close()
