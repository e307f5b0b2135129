"""The HTTP worker end to end: a real `framewire serve` process, real sockets, real ffmpeg."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from framewire.client import AsyncClient, BadRequest, Client, Forbidden, NotFound
from framewire.core.shm import shared

from tests.support.cli import run_cli
from tests.support.http import http_client
from tests.support.media import make_clip, reference_mp4, sha256
from tests.support.requests import Request, post_raw, staging_unaccounted, wait_for_ffmpeg
from tests.support.segments import raw_bytes, shm_source
from tests.support.worker import Worker

WORKER_ARGS = (
    "--chunk-bytes",
    str(1 << 20),
)  # the module's worker (tests/conftest.py)


@pytest.fixture(scope="module")
def baseline(worker: Worker) -> dict[str, object]:
    """The worker's resources after one warm-up encode, for the leak check at the end."""
    with Client(worker.uds_url) as c:
        c.save_video(make_clip(frames=2), "warmup.mp4", fps=24)
    return {"fds": len(others(worker)), "shm": ours_in_shm()}


def others(worker: Worker) -> list[str]:
    """The worker's fds but the staging it keeps between encodes (counted apart)."""
    return [f for f in worker.open_fds() if not f.startswith("/memfd:framewire-staging")]


def ours_in_shm() -> set[str]:
    """Segments made by this process's client or by its tests (tests.support.segments), not
    by the suite's other processes, whose tests run meanwhile."""
    mine = (f"framewire-{os.getpid()}-", f"framewire-test-{os.getpid()}-")
    return {n for n in os.listdir("/dev/shm") if n.startswith(mine)}


@pytest.mark.parametrize("via", ["uds", "tcp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_save_video_is_byte_exact(worker, baseline, tmp_path, via, dtype):
    clip = make_clip(frames=8, height=75, width=100, dtype=dtype)
    video = clip.permute(1, 2, 3, 0).contiguous() if dtype == torch.uint8 else clip
    url = worker.uds_url if via == "uds" else worker.tcp_url
    with Client(url) as c:
        result = c.save_video(video, f"{via}/{dtype}.mp4", fps=23.976)
    out = worker.outputs / via / f"{dtype}.mp4"
    assert result.ok and result.route == "stream"
    assert result.path == str(out)
    assert result.sha256 == sha256(out) == reference_mp4(clip, tmp_path / "ref.mp4", fps=23.976)
    assert (result.frames, result.width, result.height) == (8, 112, 80)


def test_numpy_and_batched_inputs(worker, baseline, tmp_path):
    clip = make_clip(frames=5)
    with Client(worker.uds_url) as c:
        a = c.save_video(clip.numpy(), "np.mp4", fps=24)
        b = c.save_video(clip.unsqueeze(0), "batched.mp4", fps=24)
    assert a.sha256 == b.sha256 == reference_mp4(clip, tmp_path / "ref.mp4")


def test_two_outputs_in_one_request(worker, baseline, tmp_path, wav):
    clips = [make_clip(frames=24, seed=1), make_clip(frames=6, height=75, width=100, seed=2)]
    (worker.inputs / "tone.wav").write_bytes(wav.read_bytes())
    with Client(worker.uds_url) as c:
        results = c.save_videos(
            clips, ["pair/a.mp4", "pair/b.mp4"], fps=24, audio=["tone.wav", None]
        )
    assert [r.path for r in results] == [
        str(worker.outputs / "pair" / n) for n in ("a.mp4", "b.mp4")
    ]
    assert results[0].audio is not None and results[1].audio is None
    assert results[0].sha256 == reference_mp4(clips[0], tmp_path / "a.mp4", audio=wav)
    assert results[1].sha256 == reference_mp4(clips[1], tmp_path / "b.mp4")


def test_region_used_by_two_requests(worker, baseline, segments, tmp_path):
    clips = [make_clip(frames=4, seed=s) for s in (3, 4)]
    blobs = [raw_bytes(c) for c in clips]
    key = segments.write(b"\x00" * 512 + blobs[0] + blobs[1])
    with worker.http() as h:
        total = 512 + len(blobs[0]) + len(blobs[1])
        r = h.post(
            "/v2/systemsharedmemory/region/clips/register",
            json={"key": key, "offset": 512, "byte_size": total - 512},
        )
        assert r.status_code == 200, r.text
        dup = h.post(
            "/v2/systemsharedmemory/region/clips/register",
            json={"key": key, "offset": 0, "byte_size": 16},
        )
        assert dup.status_code == 400 and "error" in dup.json()
        status = h.get("/v2/systemsharedmemory/region/clips/status").json()
        assert status == [{"name": "clips", "key": key, "offset": 512, "byte_size": total - 512}]
        for i, clip in enumerate(clips):
            src = shm_source(key, clip) | {
                "kind": "region",
                "region": "clips",
                "offset": i * len(blobs[0]),
            }
            del src["key"]
            r = h.post(
                "/v1/videos:encode",
                json={"outputs": [{"source": src, "path": f"region{i}.mp4", "fps": 24}]},
            )
            assert r.status_code == 200, r.text
            assert r.json()["outputs"][0]["sha256"] == reference_mp4(clip, tmp_path / f"{i}.mp4")
        src = shm_source(key, clips[0]) | {"kind": "region", "region": "clips", "offset": 1 << 20}
        del src["key"]
        r = h.post(
            "/v1/videos:encode", json={"outputs": [{"source": src, "path": "x.mp4", "fps": 24}]}
        )
        assert (r.status_code, r.json()["code"]) == (400, "region_out_of_bounds")
        assert h.post("/v2/systemsharedmemory/region/clips/unregister").status_code == 200
        missing = h.get("/v2/systemsharedmemory/region/clips/status")
        assert missing.status_code == 404 and "error" in missing.json()


def test_unregister_returns_while_a_request_uses_the_region(worker, baseline, segments):
    """Triton's semantics: the region leaves at once; the request using it is not disturbed."""
    clip = make_clip(frames=48, height=256, width=256)
    key = segments.write(raw_bytes(clip))
    with worker.http() as h:
        h.post(
            "/v2/systemsharedmemory/region/busy/register",
            json={"key": key, "offset": 0, "byte_size": len(raw_bytes(clip))},
        ).raise_for_status()
        src = shm_source(key, clip) | {"kind": "region", "region": "busy"}
        del src["key"]
        body = {"outputs": [{"source": src, "path": "busy.mp4", "fps": 24, "preset": "slow"}]}
        request = Request(worker, "POST", "/v1/videos:encode", json=body)
        wait_for_ffmpeg(worker)
        assert h.post("/v2/systemsharedmemory/region/busy/unregister").status_code == 200
        unregistered = time.time()  # the clock of the worker's finished_at
        response = request.result()
    assert response.status_code == 200, response.text
    assert unregistered < response.json()["outputs"][0]["timings"]["finished_at"]


def bad(worker: Worker, body: dict, status: int, code: str, token: str | None = None) -> None:
    before = {p for p in worker.outputs.rglob("*")}
    with worker.http(token) as h:
        r = h.post("/v1/videos:encode", json=body)
        assert (r.status_code, r.json().get("code")) == (status, code), r.text
        assert r.json()["error"]
        assert h.get("/healthz").status_code == 200
    assert {p for p in worker.outputs.rglob("*")} == before, "a bad request left a file"


def one(src: dict, path: str = "bad.mp4", **kw: object) -> dict:
    return {"outputs": [{"source": src, "path": path, "fps": 24} | kw]}


def test_bad_inputs_get_their_4xx(worker, baseline, segments, tmp_path):
    clip = make_clip(frames=3)
    data = raw_bytes(clip)
    key = segments.write(data)
    small = segments.write(data[: len(data) // 2])
    other = segments.write(data, prefix="/elsewhere-")
    ok = shm_source(key, clip)
    bad(worker, one(shm_source(small, clip)), 400, "segment_too_small")
    bad(worker, one(ok | {"byte_size": len(data) - 4}), 400, "byte_size_mismatch")
    bad(worker, one(ok | {"dtype": "float16"}), 400, "byte_size_mismatch")
    bad(worker, one(ok | {"shape": [4, 3, 48, 64]}), 400, "bad_shape")
    bad(worker, one(ok | {"dtype": "int64"}), 400, "bad_dtype")
    bad(worker, one(ok | {"offset": 64}), 400, "segment_too_small")
    bad(worker, one(ok | {"key": "/framewire-test-nope"}), 404, "shm_not_found")
    bad(worker, one(ok | {"key": other}), 403, "shm_prefix")
    bad(worker, one(ok | {"layout": "HWCT"}), 400, "bad_layout")
    bad(worker, one(ok | {"kind": "pickle"}), 400, "bad_source_kind")
    bad(worker, one({k: v for k, v in ok.items() if k != "kind"}), 400, "bad_source_kind")
    bad(worker, one(ok, fps=0), 400, "bad_fps")
    bad(worker, one(ok, fps=-5), 400, "bad_fps")
    bad(worker, one(ok, path="/etc/evil.mp4"), 403, "path_outside_roots")
    bad(worker, one(ok, path=str(tmp_path / "evil.mp4")), 403, "path_outside_roots")
    bad(worker, one(ok, path="../evil.mp4"), 403, "path_traversal")
    bad(worker, one(ok, path="a/../../evil.mp4"), 403, "path_traversal")
    (worker.outputs / "escape").symlink_to(tmp_path)
    bad(worker, one(ok, path="escape/evil.mp4"), 403, "path_outside_roots")
    (worker.outputs / "link.mp4").symlink_to(tmp_path / "target.mp4")
    bad(worker, one(ok, path="link.mp4"), 403, "path_outside_roots")
    bad(worker, one(ok, audio="/etc/passwd"), 403, "path_outside_roots")
    bad(worker, one(ok, audio="missing.wav"), 404, "not_found")
    bad(worker, one(ok, quality=10.01), 400, "bad_quality")
    bad(worker, {"outputs": []}, 400, "bad_request")
    assert not (tmp_path / "evil.mp4").exists() and not (tmp_path / "target.mp4").exists()
    with worker.http() as h:
        r = h.post("/v1/videos:encode", content=b"{not json")
        assert r.status_code == 400
    (worker.outputs / "escape").unlink()
    (worker.outputs / "link.mp4").unlink()


def test_client_errors_are_typed(worker, baseline):
    with Client(worker.uds_url) as c:
        with pytest.raises(Forbidden) as err:
            c.save_video(make_clip(frames=2), "/etc/x.mp4", fps=24)
        assert err.value.code == "path_outside_roots"
        with pytest.raises(BadRequest) as err:
            c.save_video(make_clip(frames=2), "x.mp4", fps=0.0)
        assert err.value.code == "bad_fps"
        with pytest.raises(NotFound):
            c.probe(["nothing-here.mp4"])
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"framewire-{os.getpid()}-")]


def test_probe_info_readyz_metrics(worker, baseline):
    with Client(worker.tcp_url) as c:
        c.save_video(make_clip(frames=5), "probe/a.mp4", fps=16)
        [info] = c.probe([str(worker.outputs / "probe" / "a.mp4")])
        assert (info.frames, info.fps, info.codec) == (5, 16.0, "h264")
        about = c.info()
        assert about["ffmpeg_version"].startswith("ffmpeg version")
        assert about["sockets"]["uds"] == str(worker.uds)
    with worker.http() as h:
        assert h.get("/readyz").json() == {"ready": True}
        text = h.get("/metrics").text
    assert 'framewire_requests_total{route="/v1/videos:encode",status="200"}' in text
    assert "framewire_encode_seconds_bucket" in text
    assert "framewire_bytes_written_total" in text
    assert "framewire_fallbacks_total" in text
    assert "framewire_encodes_in_flight" in text


def test_openapi_sources_name_their_kind(worker):
    with worker.http() as h:
        schemas = h.get("/openapi.json").json()["components"]["schemas"]
    kinds = {}
    for name in ("ShmSource", "RegionSource", "CudaIpcSource"):
        # The tag of the union: required on the wire, though Python callers may omit it.
        assert "kind" in schemas[name]["required"], schemas[name]
        kinds[name] = schemas[name]["properties"]["kind"]["const"]
    assert kinds == {"ShmSource": "shm", "RegionSource": "region", "CudaIpcSource": "cuda_ipc"}


def test_async_client(worker, baseline, tmp_path):
    clip = make_clip(frames=4, dtype=torch.bfloat16)

    async def go():
        async with AsyncClient(worker.uds_url) as c:
            return await c.save_videos([clip, clip], ["async/a.mp4", "async/b.mp4"], fps=24)

    results = asyncio.run(go())
    ref = reference_mp4(clip, tmp_path / "ref.mp4")
    assert [r.sha256 for r in results] == [ref, ref]


def test_torch_tensor_already_in_shared_memory_is_not_copied(worker, baseline, tmp_path):
    import torch.multiprocessing as tmp

    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        clip = make_clip(frames=4).share_memory_()
        with shared(clip) as src:
            assert src.key.startswith("/torch_")  # described where it lies
        with Client(worker.uds_url) as c:
            r = c.save_video(clip, "torchshm.mp4", fps=24)
        assert r.sha256 == reference_mp4(clip, tmp_path / "ref.mp4")
    finally:
        tmp.set_sharing_strategy(old)


def test_client_disconnect_kills_ffmpeg_and_removes_temp(worker, baseline, segments):
    clip = make_clip(frames=240, height=256, width=256)
    key = segments.write(raw_bytes(clip))
    sock = post_raw(worker.uds, one(shm_source(key, clip), path="gone.mp4", preset="veryslow"))
    deadline = time.monotonic() + 10
    while not worker.children():
        assert time.monotonic() < deadline, "ffmpeg never started"
        time.sleep(0.02)
    sock.close()
    deadline = time.monotonic() + 10
    while worker.children() or [
        p for p in worker.outputs.iterdir() if p.name.startswith(".framewire")
    ]:
        assert time.monotonic() < deadline, "ffmpeg or its temp file outlived the client"
        time.sleep(0.05)
    assert not (worker.outputs / "gone.mp4").exists()


def test_cli_encode_and_probe_through_worker(worker, baseline, tmp_path):
    clip = make_clip(frames=6, height=75, width=100)
    np.save(tmp_path / "clip.npy", clip.numpy())
    out = worker.outputs / "cli" / "c.mp4"
    out.parent.mkdir(exist_ok=True)
    run = run_cli("encode", str(tmp_path / "clip.npy"), str(out), "--fps", "24",
                  "--url", worker.uds_url, "--worker-only")  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert ", route stream, " in run.stdout, run.stdout  # the worker's, not this process's
    assert sha256(out) == reference_mp4(clip, tmp_path / "ref.mp4")
    run = run_cli("probe", str(out), "--url", worker.tcp_url, timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["frames"] == 6


def test_zz_nothing_leaked(worker, baseline):
    """Runs last in this module: after everything above, the worker holds what it held."""
    deadline = time.monotonic() + 5
    while True:
        fds = others(worker)
        leaked_shm = ours_in_shm() - baseline["shm"]  # type: ignore[operator]
        temps = [p for p in worker.outputs.rglob(".framewire-tmp-*")]
        with worker.http() as http:
            staging = staging_unaccounted(worker, http)
        children = worker.children()
        clean = not (children or temps or leaked_shm or staging)
        if len(fds) <= baseline["fds"] and clean:
            break
        if time.monotonic() > deadline:
            pytest.fail(
                f"leaks: fds {len(fds)} vs {baseline['fds']} ({fds}), children "
                f"{children}, temps {temps}, shm {leaked_shm}, {staging}"
            )
        time.sleep(0.1)
    assert not [f for f in fds if "memfd:" in f]


def test_token_required_when_set(workers):
    w = workers.start("--token", "s3cret")
    body = one(
        {
            "kind": "shm",
            "key": "/framewire-x",
            "byte_size": 1,
            "dtype": "uint8",
            "shape": [1, 1, 1, 3],
            "layout": "THWC",
        }
    )
    bad(w, body, 401, "unauthorized")
    bad(w, body, 401, "unauthorized", token="wrong")
    with w.http() as h:
        assert h.get("/healthz").status_code == 200
        assert h.get("/v1/info").status_code == 401
    with w.http("s3cret") as h:
        assert h.get("/v1/info").status_code == 200
    clip = make_clip(frames=2)
    with Client(w.uds_url, token="s3cret") as c:
        assert c.save_video(clip, "ok.mp4", fps=24).ok
    with Client(w.uds_url) as c, pytest.raises(Forbidden):
        c.save_video(clip, "no.mp4", fps=24)


def test_client_segments_are_private_and_swept_once_abandoned(tmp_path):
    from framewire.core.shm import remove_abandoned_segments

    dead = subprocess.Popen(["true"])
    dead.wait()
    abandoned = Path(f"/dev/shm/framewire-{dead.pid}-0-0123abcd")
    abandoned.write_bytes(b"x")
    not_ours = Path(f"/dev/shm/framewire-{dead.pid}-notes")
    not_ours.write_bytes(b"x")
    try:
        assert f"/{abandoned.name}" in remove_abandoned_segments()
        assert not abandoned.exists() and not_ours.exists()
        with shared(np.zeros((3, 1, 2, 2), np.float32)) as live:  # its creator, alive
            assert live.key not in remove_abandoned_segments()
            assert Path(f"/dev/shm{live.key}").stat().st_mode & 0o777 == 0o600
    finally:
        abandoned.unlink(missing_ok=True)
        not_ours.unlink()


def test_tcp_answers_are_not_held_by_delayed_acks(worker):
    """On a kept-alive TCP connection each answer must go out at once (TCP_NODELAY):
    without it, every request after the first waited ~40 ms for a delayed ACK."""
    with http_client(worker.tcp_url) as http:
        times = []
        for _ in range(21):
            t0 = time.perf_counter()
            assert http.post("/v1/probe", json={"paths": []}).status_code < 500
            times.append(time.perf_counter() - t0)
    assert sorted(times)[10] < 0.02, f"median {sorted(times)[10] * 1e3:.1f} ms"
