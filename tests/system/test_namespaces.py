"""A rank in another container: its own IPC, PID and mount namespaces, sharing with the worker
only the directory that holds the sockets (as two containers share one volume).

The fd handover must work there, byte-exact; the named-segment route cannot (the
rank's /dev/shm is not the worker's), and must say so with ``shm_not_found``.
Made with ``unshare`` (root, as in CI); nothing is mocked.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.media import make_clip, reference_mp4, sha256
from tests.support.real import unavailable

RANK = r"""
import json, os, sys
import httpx, numpy as np
from framewire.client import Client
from framewire.core.shm import shared

sockets = sys.argv[1]
clip = np.load(sys.argv[2])
out = {"pid": os.getpid(), "worker_root_visible": sorted(os.listdir(sys.argv[3]))}
with Client(f"unix://{sockets}/api.sock", fd_socket=f"{sockets}/fd.sock") as c:
    result = c.save_video(clip, "from-another-container.mp4", fps=24)
    out |= {"route": c.host_route, "sha256": result.sha256, "path": result.path}
    stream = c.open_video("streamed-from-another-container.mp4", fps=24)
    with stream:
        for t0 in range(0, clip.shape[1], 2):
            stream.write(clip[:, t0 : t0 + 2])
    out["stream_sha256"] = stream.result.sha256
with shared(clip) as source:  # a named segment, in this container's own /dev/shm
    body = {"outputs": [{"source": source.model_dump(mode="json"), "path": "shm.mp4", "fps": 24}]}
    transport = httpx.HTTPTransport(uds=f"{sockets}/api.sock")
    with httpx.Client(transport=transport, base_url="http://framewire", timeout=60) as h:
        r = h.post("/v1/videos:encode", json=body)
    out["named_segment"] = [r.status_code, r.json()["code"]]
out["dev_shm"] = sorted(os.listdir("/dev/shm"))
print(json.dumps(out))
"""


def isolated(volume: Path, at: Path, *argv: str) -> list[str]:
    """``argv`` in new IPC, PID and mount namespaces: a private /dev/shm, its own /proc,
    ``volume`` bound in at ``at`` (an empty directory) and then covered by an empty tmpfs
    where it was."""
    inner = (
        f"set -e; mount -t tmpfs tmpfs /dev/shm; mount --bind {volume} {at}; "
        f'mount -t tmpfs tmpfs {volume}; exec "$@"'
    )
    return ["unshare", "--ipc", "--pid", "--fork", "--mount", "--mount-proc",
            "sh", "-c", inner, "sh", *argv]  # fmt: skip


@pytest.fixture
def can_unshare() -> None:
    if shutil.which("unshare") is None:
        unavailable("needs util-linux unshare")
    probe = subprocess.run(["unshare", "--ipc", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        unavailable(f"cannot make namespaces here: {probe.stderr.decode().strip()}")


def test_a_rank_in_another_container_encodes_over_the_fd_socket(workers, tmp_path, can_unshare):
    volume = tmp_path / "volume"  # the shared volume: the sockets and the outputs
    w = workers.start(root=volume)
    clip = make_clip(frames=6, height=48, width=64).numpy()
    rank = tmp_path / "rank"  # the rank's own files: its clip, where the volume is mounted
    (rank / "volume").mkdir(parents=True)
    np.save(rank / "clip.npy", clip)
    run = subprocess.run(
        isolated(volume, rank / "volume", sys.executable, "-c", RANK, str(rank / "volume"),
                 str(rank / "clip.npy"), str(volume)),
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["pid"] < 10  # its own PID namespace
    assert out["worker_root_visible"] == []  # nothing of the worker's tree but the volume
    expected = reference_mp4(clip, tmp_path / "ref.mp4")
    assert out["route"] == "fd"
    assert out["sha256"] == expected == sha256(w.outputs / "from-another-container.mp4")
    assert out["stream_sha256"] == expected
    assert sha256(w.outputs / "streamed-from-another-container.mp4") == expected
    assert out["named_segment"] == [404, "shm_not_found"]  # a name in the rank's /dev/shm only
    assert out["dev_shm"] == []  # the fd handover made no name; the named one was unlinked
    with w.http() as h:
        assert h.get("/v2/systemsharedmemory/status").json() == []
