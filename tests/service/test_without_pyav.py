"""A worker on a host without PyAV (scripts/gpu-check's bare GPU host): it says so when
it starts, still writes byte-exact outputs (unvalidated), and answers what needs PyAV
with 503 ``pyav_missing`` while it keeps serving."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from framewire.client import Client, Unavailable
from framewire.service._probe import PYAV_MISSING

from tests.support.media import make_clip, reference_mp4, sha256
from tests.support.worker import Worker, Workers


@pytest.fixture
def bare_worker(workers: Workers, tmp_path: Path) -> Worker:
    # An ``av`` package first on the path whose import fails, as PyAV's absence does.
    blocker = tmp_path / "no-pyav" / "av"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('PyAV is absent here')\n")
    path = os.pathsep.join(filter(None, [str(blocker.parent), os.environ.get("PYTHONPATH")]))
    return workers.start("--log-level", "warning", env=os.environ | {"PYTHONPATH": path})


def test_a_worker_without_pyav_encodes_unvalidated_and_says_so(bare_worker, tmp_path):
    assert PYAV_MISSING in bare_worker.log.read_text()
    clip = make_clip(frames=9, height=48, width=64, dtype=torch.float32)
    with Client(bare_worker.uds_url) as c:
        result = c.save_video(clip, "a.mp4", fps=24, validate=True)
        assert result.ok and result.timings.validate_ms == 0.0
        assert (result.width, result.duration) == (None, None)  # nothing probed it
        assert (
            result.sha256
            == reference_mp4(clip, tmp_path / "ref.mp4")
            == sha256(bare_worker.outputs / "a.mp4")
        )
        with pytest.raises(Unavailable) as refused:
            c.save_video(clip, "b.mp4", fps=24, profile="vllm-omni")
        assert refused.value.code == "pyav_missing"
    assert not (bare_worker.outputs / "b.mp4").exists()
    with bare_worker.http() as h:
        assert h.get("/v1/info").json()["pyav"] is None
        probed = h.post("/v1/probe", json={"paths": [str(bare_worker.outputs / "a.mp4")]})
        assert (probed.status_code, probed.json()["code"]) == (503, "pyav_missing")
        assert h.get("/readyz").json() == {"ready": True}  # still serving
