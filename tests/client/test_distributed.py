"""decode_reference_shared in a real 4-rank gloo group playing two hosts, each with its worker.

Ranks 0 and 1 use worker A, ranks 2 and 3 worker B; each "host" has its own input
root, as separate machines would.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import torch.distributed as dist
from framewire.client import MediaError
from framewire.client.distributed import _error, _status, decode_reference_shared

from tests.support.dist_ranks import run_ranks
from tests.support.refclips import make_video, oracle
from tests.support.worker import metric

PARAMS = {"fps": 12, "width": 40, "height": 24, "max_frames": 15}


def test_two_hosts_share_fall_back_and_fail_together(workers, tmp_path):
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    worker_a, worker_b = workers.start(root=host_a), workers.start(root=host_b)
    video = make_video(worker_a.inputs / "ref.mp4", "testsrc2=size=97x61:rate=25", 1.2)
    shutil.copy(video, worker_b.inputs / "ref.mp4")
    make_video(worker_a.inputs / "only-a.mp4", "testsrc2=size=97x61:rate=30", 0.6)
    on = [host_a / "fd.sock"] * 2 + [host_b / "fd.sock"] * 2
    down = [host_a / "fd.sock"] * 2 + [host_b / "down.sock"] * 2  # B's worker is gone
    roots = [worker_a.inputs] * 2 + [worker_b.inputs] * 2

    def paths(name: str) -> list[str]:
        return [str(root / name) for root in roots]

    scenarios = [
        {"name": "shared", "sockets": on, "paths": paths("ref.mp4")},
        {"name": "b_down", "sockets": down, "paths": paths("ref.mp4")},
        {"name": "missing_on_b", "sockets": on, "paths": paths("only-a.mp4")},
    ]
    config = {
        "world": 4,
        "store": str(tmp_path / "store"),
        "out": str(tmp_path),
        "scenarios": [s | {"params": PARAMS, "sockets": [str(p) for p in s["sockets"]]}
                      for s in scenarios],
    }  # fmt: skip
    ranks = run_ranks(config, tmp_path)
    with worker_a.http() as ha, worker_b.http() as hb:
        decodes = (metric(ha, "framewire_decodes_total"), metric(hb, "framewire_decodes_total"))
    workers.stop_all()  # before the checks: the workers' work is done

    expected = hashlib.sha256(oracle(video, **PARAMS)).hexdigest()
    # (1) every rank has the same bytes, each host decoded once
    shared = [r["shared"] for r in ranks]
    assert [(s["ok"], s["sha256"], s["source"]) for s in shared] == [(True, expected, "worker")] * 4
    # (2) B's worker down: its ranks decode locally, same bytes, nobody waits for long
    down_results = [r["b_down"] for r in ranks]
    assert [s["sha256"] for s in down_results] == [expected] * 4
    assert [s["source"] for s in down_results] == ["worker", "worker", "local", "local"]
    # (3) the file exists on host A only: all four ranks raise the same error, promptly
    failed = [r["missing_on_b"] for r in ranks]
    assert all(not f["ok"] for f in failed)
    assert {(f["error"], f["code"], f["message"]) for f in failed} == {
        (failed[0]["error"], "not_found", failed[0]["message"])
    }
    assert failed[0]["error"] == "NotFound"
    assert "rank 2" in failed[0]["message"] and "2 of 4 ranks failed" in failed[0]["message"]
    assert max(r[name]["seconds"] for r in ranks for name in ("b_down", "missing_on_b")) < 20
    # ref.mp4 once per host; only-a.mp4 once on A (B never got to ffmpeg)
    assert decodes == (2, 1)


def test_first_failing_rank_decides_the_error():
    statuses = [
        _status(None, 0),
        _status(MediaError("bad bytes", code="decode_failed", detail="ffmpeg said no"), 1),
        _status(ValueError("boom"), 2),
    ]
    err = _error(statuses)
    assert isinstance(err, MediaError) and err.code == "decode_failed"
    assert "rank 1" in err.message and "bad bytes" in err.message and "2 of 3" in err.message
    assert err.detail == "ffmpeg said no"
    assert json.loads(json.dumps(statuses)) == statuses  # plain data only crosses ranks


def test_without_a_process_group_it_is_a_plain_decode(tmp_path, monkeypatch):
    assert not dist.is_initialized()
    video = make_video(tmp_path / "v.mp4", "testsrc2=size=32x32:rate=10", 0.5)
    monkeypatch.setenv("FRAMEWIRE_FD_SOCKET", str(tmp_path / "none.sock"))
    with decode_reference_shared(video, fps=5, width=8, height=8) as ref:
        assert ref.source == "local"
        assert ref.frames.tobytes() == oracle(video, fps=5, width=8, height=8)
