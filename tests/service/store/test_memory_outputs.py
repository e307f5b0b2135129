"""Outputs to memory (``memory://name.mp4``): encoded and validated as files are, held in a
sealed memfd, taken once over the fd socket; the bytes are the file's, nothing stays."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from framewire.client import BadRequest, Client, NotFound
from framewire.core.fdsocket import take_output

from tests.support.media import make_clip
from tests.support.processes import is_spool, spools


def test_a_memory_output_is_the_files_bytes_taken_once(worker, tmp_path):
    clip = make_clip(frames=6, height=48, width=64, seed=5)
    with Client(worker.uds_url, fd_socket=worker.fd_socket) as fw:
        on_disk = fw.save_video(clip, worker.outputs / "a.mp4", fps=24)
        [held] = fw.save_videos([clip], ["memory://a.mp4"], fps=24)
        assert held.path == held.url == "memory://a.mp4" and held.handoff is not None
        assert held.data is not None and hashlib.sha256(held.data).hexdigest() == held.sha256
        assert held.sha256 == on_disk.sha256 and held.bytes == len(held.data)
        assert "data" not in held.model_dump()  # never on the wire
        with pytest.raises(NotFound) as again:
            take_output(held.handoff, worker.fd_socket, 10)  # once per ticket
        assert again.value.code == "handoff_not_found"
        with fw.open_video("memory://b.mp4", fps=24) as writer:
            for t0 in range(0, 6, 2):
                writer.write(clip[:, t0 : t0 + 2])
        assert writer.result is not None and writer.result.data is not None
        assert hashlib.sha256(writer.result.data).hexdigest() == on_disk.sha256
        for bad in ("memory://a.gif", "memory://../a.mp4", "memory://"):
            with pytest.raises(BadRequest) as refused:
                fw.save_video(np.zeros((2, 16, 16, 3), np.uint8), bad, fps=24)
            assert refused.value.code == "bad_url"
    assert all(list(spool.iterdir()) == [] for spool in spools(worker.outputs))
    assert sorted(p.name for p in worker.outputs.iterdir() if not is_spool(p)) == ["a.mp4"]
