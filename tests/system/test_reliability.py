"""The fault matrix: each fault made for real against a real worker, and what follows.

For every case: a clear error or a correct (byte-exact) result, nothing at the
output path unless it is complete, nothing leaked (fds, memfds, /dev/shm
segments, temp outputs, child processes), and the worker still serving. Each
test records what it observed; the last one checks docs/RELIABILITY.md against
those records (``scripts/reliability-report`` rewrites it).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from framewire.client import Client, OutputResult
from framewire.core.shm import remove_abandoned_segments

from tests.support import faultmatrix
from tests.support.dist_ranks import run_ranks
from tests.support.media import FFMPEG, make_clip, reference_mp4, sha256
from tests.support.processes import framewire_temps, gone, wait_gone
from tests.support.refclips import make_video, oracle
from tests.support.requests import Baseline, encode_body, settle, still_serving, wait_for_ffmpeg
from tests.support.segments import raw_bytes, shm_source
from tests.support.worker import Worker, metric

CLEAN = "nothing leaked; the next encode is byte-exact"


WORKER_ARGS = (
    "--chunk-bytes",
    str(1 << 20),
)  # the module's worker (tests/conftest.py)


@pytest.fixture(scope="module")
def baseline(worker: Worker) -> Baseline:
    clip = make_clip(frames=2, height=32, width=32)
    key = f"/framewire-test-warmup-{os.getpid()}"
    Path(f"/dev/shm{key}").write_bytes(raw_bytes(clip))
    try:
        with worker.http() as http:
            body = encode_body(shm_source(key, clip), "warm.mp4")
            assert http.post("/v1/videos:encode", json=body).is_success
    finally:
        os.unlink(f"/dev/shm{key}")
    (worker.outputs / "warm.mp4").unlink()
    return Baseline.of(worker)


def post_encode(worker: Worker, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    with worker.http() as http:
        r = http.post("/v1/videos:encode", json=body)
    return r.status_code, r.json()


def when_ffmpeg_runs(worker: Worker, action: Any) -> threading.Thread:
    """Run ``action(pids)`` on a thread as soon as the worker has a child process."""

    def run() -> None:
        action(wait_for_ffmpeg(worker))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def error_of(status: int, body: dict[str, Any]) -> str:
    return f"HTTP {status} `{body['code']}`"


# --- ffmpeg --------------------------------------------------------------------------------


def test_ffmpeg_killed_mid_encode(worker, baseline, segments, tmp_path, request):
    """SIGKILL to the worker's ffmpeg as soon as it runs, mid-way through a 48-frame clip."""
    clip = make_clip(frames=48, height=160, width=160)
    killed: list[int] = []
    t = when_ffmpeg_runs(worker, lambda pids: [os.kill(p, signal.SIGKILL) or killed.append(p)
                                               for p in pids])  # fmt: skip
    status, body = post_encode(
        worker, encode_body(segments.source(clip), "killed.mp4", preset="slow")
    )
    t.join()
    assert killed and status == 200, body
    out = body["outputs"][0]
    assert out["route"] == "fallback"
    expected = reference_mp4(clip, tmp_path / "ref.mp4", preset="slow")
    assert out["sha256"] == expected == sha256(worker.outputs / "killed.mp4")
    settle(worker, baseline, keep=frozenset(segments.keys))
    still_serving(worker, segments, tmp_path)
    (worker.outputs / "killed.mp4").unlink()
    faultmatrix.record(
        request,
        fault="ffmpeg killed mid-encode",
        observed=f"HTTP {status}, `route: {out['route']}`: redone on the fallback route",
        output="the complete file; sha256 equal to imageio's",
        afterwards=CLEAN,
    )


def wrapped_ffmpeg(path: Path, prelude: str) -> Path:
    """An ffmpeg for ``FRAMEWIRE_FFMPEG``: a shell script running ``prelude``, then ffmpeg."""
    path.write_text(f'#!/bin/sh\n{prelude}\nexec {FFMPEG} "$@"\n')
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("sigxfsz", ["ignored", "default"])
def test_full_disk(workers, tmp_path, segments, request, sigxfsz):
    """ffmpeg runs under RLIMIT_FSIZE of 32 KiB, the output of a 24-frame clip being larger.
    With SIGXFSZ ignored its writes fail with EFBIG, as ENOSPC would on a full disk; with the
    signal's default action ffmpeg is killed by it."""
    # dash's ulimit -f counts 512-byte blocks: 32 KiB, much less than the clip's MP4.
    trap = "trap '' XFSZ; " if sigxfsz == "ignored" else ""
    wrapper = wrapped_ffmpeg(tmp_path / "ffmpeg", f"{trap}ulimit -f 64")
    w = workers.start(env=os.environ | {"FRAMEWIRE_FFMPEG": str(wrapper)})
    baseline = Baseline.of(w)
    clip = make_clip(frames=24, height=128, width=128)
    status, body = post_encode(w, encode_body(segments.source(clip), "full.mp4", quality=10))
    assert (status, body["code"]) == (507, "no_space"), body
    detail = body["outputs"][0]["error"]["detail"] or ""
    assert sigxfsz == "default" or "File too large" in detail
    assert not (w.outputs / "full.mp4").exists()
    with w.http() as http:
        assert metric(http, "framewire_fallbacks_total") == 0  # not retried
    settle(w, baseline, keep=frozenset(segments.keys))
    still_serving(w, segments, tmp_path)  # a small output still fits
    faultmatrix.record(
        request,
        fault=f"output filesystem full (SIGXFSZ {sigxfsz})",
        observed=error_of(status, body) + " with ffmpeg's stderr tail; not retried",
        output="nothing",
        afterwards="nothing leaked; a smaller encode still succeeds, byte-exact",
    )


# --- clients -------------------------------------------------------------------------------


def owned_segments(pid: int) -> list[str]:
    """The client's shm segments made by ``pid`` (named after it)."""
    return sorted(f"/{n}" for n in os.listdir("/dev/shm") if n.startswith(f"framewire-{pid}-"))


CLIENT = """
import sys, numpy as np
from framewire.client import Client
with Client("unix://" + sys.argv[1], **eval(sys.argv[3])) as c:
    c.save_video(np.load(sys.argv[2]), "orphan.mp4", fps=24, preset="veryslow")
"""
# How a client's host frames reach the worker (the handover): over the fd socket (what a
# client of this worker does), or through a named segment (a client without the fd socket).
HANDOVERS = {"fd": {}, "shm": {"fd_socket": "/nonexistent/fd.sock"}}


@pytest.mark.parametrize("handover", list(HANDOVERS))
def test_client_killed_mid_request(worker, baseline, segments, tmp_path, request, handover):
    """A client process calls save_video with a 120-frame clip and is SIGKILLed once ffmpeg
    runs."""
    np.save(tmp_path / "clip.npy", make_clip(frames=120, height=192, width=192).numpy())
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(worker.uds), tmp_path / "clip.npy",
         repr(HANDOVERS[handover])]
    )  # fmt: skip
    try:
        ffmpeg = wait_for_ffmpeg(worker, naming="orphan.mp4")  # its encode's
        # What it holds as it dies is what it leaves (read while it lives: once it is dead,
        # any process of the suite that shares or starts a worker may sweep it).
        left = owned_segments(client.pid)
        client.kill()
    finally:
        client.wait()
    started = time.monotonic()
    wait_gone(ffmpeg)
    stopped_s = time.monotonic() - started
    if handover == "shm":
        assert len(left) == 1  # the killed client could not unlink its segment...
        remove_abandoned_segments()  # ...the next client's first share does
        assert owned_segments(client.pid) == []
        released = (
            "the killed client's shm segment is unlinked by the next client's first share"
            " (or the worker's next start)"
        )
    else:
        assert left == []  # no name was ever made; the region went with the connection
        with worker.http() as h:
            assert h.get("/v2/systemsharedmemory/status").json() == []
        released = "the killed client's region went with its fd-socket connection"
    settle(worker, baseline, keep=frozenset(segments.keys))
    assert not (worker.outputs / "orphan.mp4").exists()
    still_serving(worker, segments, tmp_path)
    assert stopped_s < 5
    faultmatrix.record(
        request,
        fault=f"client killed mid-request ({handover} handover)",
        observed="the encode is cancelled: ffmpeg killed within 5 s of the disconnect",
        output="nothing",
        afterwards=f"nothing leaked by the worker; {released}; the next encode is byte-exact",
    )


def test_shm_truncated_mid_encode(worker, baseline, segments, tmp_path, request):
    """The client shrinks its segment to 4 KiB once ffmpeg runs (96 frames, 1 MiB chunks)."""
    clip = make_clip(frames=96, height=256, width=256)
    src = segments.source(clip)
    t = when_ffmpeg_runs(worker, lambda _: os.truncate(f"/dev/shm{src['key']}", 4096))
    status, body = post_encode(worker, encode_body(src, "trunc.mp4", preset="medium"))
    t.join()
    assert (status, body["code"]) == (400, "segment_truncated"), body
    assert not (worker.outputs / "trunc.mp4").exists()
    settle(worker, baseline, keep=frozenset(segments.keys))
    still_serving(worker, segments, tmp_path)
    faultmatrix.record(
        request,
        fault="shm segment truncated mid-encode",
        observed=error_of(status, body),
        output="nothing",
        afterwards=CLEAN,
    )


def test_shm_unlinked_mid_encode(worker, baseline, segments, tmp_path, request):
    """The client unlinks its segment once ffmpeg runs; the worker holds it open."""
    clip = make_clip(frames=48, height=128, width=128)
    src = segments.source(clip)
    t = when_ffmpeg_runs(worker, lambda _: os.unlink(f"/dev/shm{src['key']}"))
    status, body = post_encode(worker, encode_body(src, "unlinked.mp4"))
    t.join()
    assert status == 200, body
    assert not Path(f"/dev/shm{src['key']}").exists()
    expected = reference_mp4(clip, tmp_path / "ref.mp4")
    assert body["outputs"][0]["sha256"] == expected == sha256(worker.outputs / "unlinked.mp4")
    (worker.outputs / "unlinked.mp4").unlink()
    settle(worker, baseline, keep=frozenset(segments.keys))  # its memory is freed with the fd
    still_serving(worker, segments, tmp_path)
    faultmatrix.record(
        request,
        fault="shm segment unlinked mid-encode",
        observed=f"HTTP {status}: the open segment is read to the end",
        output="the complete file; sha256 equal to imageio's",
        afterwards=CLEAN,
    )


# --- the worker ----------------------------------------------------------------------------


def test_worker_killed_and_restarted(workers, tmp_path, segments, request):
    """SIGKILL to the worker while a client's encode runs and a decode client is connected;
    then a worker started again on the same sockets and roots."""
    w = workers.start(root=tmp_path / "host")
    video = make_video(w.inputs / "ref.mp4", "testsrc2=size=97x61:rate=25", 1.0)
    params = {"fps": 12, "width": 40, "height": 24}
    expected = oracle(video, **params)
    clip = make_clip(frames=120, height=192, width=192).numpy()
    saved: list[object] = []

    def encode(client: Client) -> None:
        try:
            saved.append(client.save_video(clip, "inflight.mp4", fps=24, preset="veryslow"))
        except BaseException as exc:
            saved.append(exc)

    # The rank's own output root: where its saves go when no worker takes them.
    rank_root = tmp_path / "rank"
    with Client(w.uds_url, fd_socket=w.uds.parent / "fd.sock", output_root=rank_root) as client:
        with client.decode_reference(str(video), **params) as ref:
            assert ref.source == "worker"  # the fd-socket connection is open now
        t = threading.Thread(target=encode, args=(client,))
        t.start()
        ffmpeg = wait_for_ffmpeg(w)
        deadline = time.monotonic() + 10
        while not framewire_temps(w.outputs):
            assert time.monotonic() < deadline, "no temp output appeared"
            time.sleep(0.01)
        os.kill(w.pid, signal.SIGKILL)
        w.proc.wait()
        t.join(120)
        for pid in ffmpeg:  # orphans: stop them rather than wait for them
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        wait_gone(ffmpeg)
        # The save the worker was killed under is done again in the client's process.
        [result] = saved
        assert isinstance(result, OutputResult) and result.route == "local", result
        want = reference_mp4(clip, tmp_path / "inflight-ref.mp4", preset="veryslow")
        assert result.sha256 == want == sha256(rank_root / "inflight.mp4")
        with client.decode_reference(str(video), **params) as ref:
            assert ref.source == "local" and np.asarray(ref.frames).tobytes() == expected
        ranks = run_ranks(
            {"world": 2, "store": str(tmp_path / "store"), "out": str(tmp_path),
             "scenarios": [{"name": "down", "params": params,
                            "sockets": [str(w.uds.parent / "fd.sock")] * 2,
                            "paths": [str(video)] * 2}]},
            tmp_path,
        )  # fmt: skip
        digest = sha256_bytes(expected)
        assert [(r["down"]["source"], r["down"]["sha256"]) for r in ranks] == [
            ("local", digest)
        ] * 2
        assert framewire_temps(w.outputs)  # what the killed worker left

        w2 = workers.start(root=tmp_path / "host")
        assert not framewire_temps(w2.outputs)  # swept at start
        assert not (w2.outputs / "inflight.mp4").exists()
        baseline = Baseline.of(w2)
        with client.decode_reference(str(video), **params) as ref:
            assert ref.source == "worker" and np.asarray(ref.frames).tobytes() == expected
        small = make_clip(frames=3, height=32, width=32).numpy()
        result = client.save_video(small, "again.mp4", fps=24)
        assert result.sha256 == reference_mp4(small, tmp_path / "again-ref.mp4")
        assert client.host_route == "fd"  # connected again, to the new worker
    settle(w2, baseline, keep=frozenset(segments.keys))  # the client's connection closed
    assert w2.stop() == 0
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"framewire-{os.getpid()}-")]
    faultmatrix.record(
        request,
        fault="worker killed and restarted while clients are connected",
        observed=(
            "in-flight encode: done again in the client's process (`route` `local`),"
            " byte-exact; decode on the open connection: done locally, byte-exact;"
            " `decode_reference_shared` (2 gloo ranks): both local, byte-exact"
        ),
        output=(
            "the file, written by the client; the killed worker's private temp directory is"
            " removed by the next start"
        ),
        afterwards=(
            "the same clients use the restarted worker: encode byte-exact (the fd handover"
            " reconnected), decode from the worker; nothing left in /dev/shm"
        ),
    )


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_reference_replaced_during_decode(workers, tmp_path, request):
    """The reference video is replaced (a new file renamed over it) while the worker's decode
    of it runs; ffmpeg is made to start 1 s late so the swap always lands inside the decode."""
    wrapper = wrapped_ffmpeg(tmp_path / "ffmpeg", "sleep 1")
    w = workers.start(env=os.environ | {"FRAMEWIRE_FFMPEG": str(wrapper)})
    baseline = Baseline.of(w)
    path = make_video(w.inputs / "ref.mp4", "testsrc2=size=97x61:rate=25", 1.0)
    new = make_video(tmp_path / "new.mp4", "mandelbrot=size=96x64:rate=25", 1.0)
    params = {"fps": 12, "width": 40, "height": 24}
    old_frames, new_frames = oracle(path, **params), oracle(new, **params)
    assert old_frames != new_frames
    t = threading.Thread(target=lambda: (wait_for_ffmpeg(w), os.replace(new, path)))
    t.start()
    with Client(w.uds_url, fd_socket=w.uds.parent / "fd.sock") as client:
        with client.decode_reference(str(path), **params) as ref:
            frames = np.asarray(ref.frames).tobytes()
            source = ref.source
        t.join()
        with w.http() as http:
            runs = metric(http, "framewire_decodes_total")
        with client.decode_reference(str(path), **params) as ref:
            again = np.asarray(ref.frames).tobytes()
        with w.http() as http:
            cached_hits = metric(http, "framewire_decode_cache_hits_total")
    assert source == "worker" and frames == new_frames and runs == 2
    assert again == new_frames and cached_hits == 0  # the answer was not cached under ref
    settle(w, baseline)
    faultmatrix.record(
        request,
        fault="reference video replaced during its decode",
        observed=(
            "the change is seen after the run (device, inode, size, mtime) and the file decoded"
            " again: the answer is the new file, byte-exact, never a mix; not cached under the"
            " old identity"
        ),
        output="(a decode: no output file)",
        afterwards="nothing leaked; the next request decodes the new file",
    )


# --- stream sessions -----------------------------------------------------------------------


def test_ffmpeg_killed_mid_stream(worker, baseline, segments, request):
    """SIGKILL to a stream session's ffmpeg between two chunks; the producer sends the next."""
    clip = make_clip(frames=8, height=64, width=64)
    with worker.http() as h:
        body = {"path": "streamed.mp4", "fps": 24, "dtype": "float32", "height": 64, "width": 64}
        sid = h.post("/v1/streams", json=body).json()["id"]
        chunk = {"first_frame": 0, "source": segments.source(clip[:, :4].contiguous())}
        assert h.post(f"/v1/streams/{sid}/frames", json=chunk).status_code == 200
        [ffmpeg] = wait_for_ffmpeg(worker)
        os.kill(ffmpeg, signal.SIGKILL)
        wait_gone({ffmpeg})
        chunk = {"first_frame": 4, "source": segments.source(clip[:, 4:].contiguous())}
        r = h.post(f"/v1/streams/{sid}/frames", json=chunk)
        state = h.get(f"/v1/streams/{sid}").json()
    assert (r.status_code, r.json()["code"]) == (422, "ffmpeg_killed"), r.text
    assert state["state"] == "failed"
    assert not (worker.outputs / "streamed.mp4").exists()
    settle(worker, baseline, keep=frozenset(segments.keys))
    faultmatrix.record(
        request,
        fault="ffmpeg killed mid-stream",
        observed=f"the next chunk: {error_of(r.status_code, r.json())}; the session is "
        "`failed` (no fallback: the frames already read are gone)",
        output="nothing",
        afterwards=CLEAN,
    )


PRODUCER = """
import sys, torch
from framewire.client import Client
clip = torch.rand(3, 96, 128, 128)
with Client("unix://" + sys.argv[1], **eval(sys.argv[2])) as c:
    w = c.open_video("orphan.mp4", fps=24, preset="veryslow")
    for t0 in range(0, 96, 8):
        w.write(clip[:, t0:t0 + 8])
    print("written", flush=True)
    sys.stdin.read()  # killed here, before close()
"""


@pytest.mark.parametrize("handover", list(HANDOVERS))
def test_producer_killed_mid_stream(workers, segments, tmp_path, request, handover):
    """SIGKILL to a producer process that wrote 12 chunks through ``open_video`` and did
    not close; the worker's ``FRAMEWIRE_STREAM_IDLE_S`` is 1 s."""
    w = workers.start("--stream-idle-s", "1")
    baseline = Baseline.of(w)
    producer = subprocess.Popen([sys.executable, "-c", PRODUCER, str(w.uds),
                                 repr(HANDOVERS[handover])],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    assert producer.stdout is not None and producer.stdout.readline() == b"written\n"
    left = owned_segments(producer.pid)  # read while it lives, as above
    producer.kill()
    producer.wait()
    killed_at, deadline = time.monotonic(), time.monotonic() + 20
    with w.http() as h:
        while metric(h, "framewire_streams_open") > 0:
            assert time.monotonic() < deadline, "the orphaned session stayed open"
            time.sleep(0.1)
        aborted_after = time.monotonic() - killed_at
        idle_aborts = metric(h, 'framewire_stream_aborts_total{cause="idle"}')
        regions = h.get("/v2/systemsharedmemory/status").json()
    assert idle_aborts == 1 and aborted_after < 5
    assert not (w.outputs / "orphan.mp4").exists()
    remove_abandoned_segments()
    if handover == "shm":
        # Its two chunk buffers outlived it; the next client's first share sweeps them.
        assert len(left) == 2 and owned_segments(producer.pid) == []
        staging = "the producer's 2 chunk buffers are swept by the next client"
    else:
        assert left == [] and regions == []
        staging = "the producer's 2 chunk buffers (regions) went with its fd-socket connection"
    settle(w, baseline)
    still_serving(w, segments, tmp_path)
    faultmatrix.record(
        request,
        fault=f"producer killed mid-stream ({handover} handover)",
        observed="the session aborted as idle within 5 s "
        f'(`framewire_stream_aborts_total{{cause="idle"}}`); {staging}',
        output="nothing",
        afterwards=CLEAN,
    )


# --- the document --------------------------------------------------------------------------


def test_zz_reliability_document_is_what_the_suite_observed():
    """Runs last: docs/RELIABILITY.md shows exactly the rows recorded above."""
    rows = list(faultmatrix.RECORDED.values())
    if os.environ.get("FRAMEWIRE_WRITE_RELIABILITY") == "1":
        faultmatrix.write(rows)
    documented = faultmatrix.documented_rows()
    for row in rows:
        assert row.markdown() in documented, (
            f"docs/RELIABILITY.md differs from what {row.test} observed; "
            "run scripts/reliability-report"
        )
    names = {line.split("|")[-2].strip() for line in documented}
    tests = {f"`tests/system/test_reliability.py::{n}`" for n in _matrix_tests()}
    assert names == tests, "docs/RELIABILITY.md lists tests that do not exist, or misses some"


def _matrix_tests() -> set[str]:
    ids = set()
    for name, fn in globals().items():
        if name.startswith("test_") and not name.startswith("test_zz"):
            marks = getattr(fn, "pytestmark", [])
            params = [m for m in marks if m.name == "parametrize"]
            if params:
                ids |= {f"{name}[{v}]" for v in params[0].args[1]}
            else:
                ids.add(name)
    return ids
