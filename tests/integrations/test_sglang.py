"""SGLang's own code (0.5.21 to 0.5.23), in SGLang's own pins (imageio-ffmpeg 0.5.1:
ffmpeg 4.2.2), saving through a real worker: its plugin loader finds framewire by the
entry point, its hook registry applies the hooks, and every output's sha256 equals
SGLang's own save of the same frames (tests/support/engine_sglang.py runs the cases).
The full set at 0.5.23; at the other versions a smoke set; a module of SGLang's whose
targets drifted, a version outside the range, and a failure of framewire's at each
stage all leave SGLang's own code running, nothing raised."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.engine_faults import STAGES
from tests.support.engine_site import (
    VERSIONS,
    engine_ffmpeg,
    engine_site,
    fake_version,
    overlay,
    run_engine,
    start_engine,
)
from tests.support.media import FFMPEG
from tests.support.worker import Worker, Workers, free_port, metric

pytestmark = pytest.mark.registry

ROUTED = ["float32", "odd-size-23.976", "bf16-audio", "stereo-inferred-rate", "two-outputs",
          "materialized", "streamed-whole"]  # fmt: skip
LEFT = ["uint8-tensor", "bad-quality"]  # SGLang's own path (uint8 via its materialized route)
HOOKED = ["_try_save_cuda_video_direct", "_try_save_cuda_videos_direct", "_save_video_ffmpeg",
          "CudaVideoEncoder.open"]  # fmt: skip
CHECKED = [*HOOKED, "minimax_h3_decode_reference_video_frames"]
UTILS_FILE = "sglang/multimodal_gen/runtime/entrypoints/utils.py"


@pytest.fixture(scope="module")
def site() -> Path:
    return engine_site("sglang")


def run(site: Path | list[Path], out: Path, names: list[str], **env: str) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    return run_engine(site, "engine_sglang", str(out), *names, **env)


def lines(log: str, text: str) -> list[str]:
    return [line for line in log.splitlines() if text in line]


@pytest.fixture(scope="module")
def own(site: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """SGLang's own saves: the integration installed (it is) but not enabled."""
    return run(site, tmp_path_factory.mktemp("own"), ROUTED + LEFT)


def test_not_enabled_nothing_is_hooked(own):
    assert own["unchanged"] == dict.fromkeys(HOOKED, True)  # the very same objects
    assert own["hooked"] == {}
    assert own["counts"] == {}
    assert "framewire:" not in own["log"]  # SGLang names the plugin it ran; we say nothing
    assert own["ffmpeg"].endswith("ffmpeg-linux64-v4.2.2")  # SGLang's pin, not ours


def test_every_save_through_the_worker_has_sglangs_bytes(site, own, workers, tmp_path):
    worker = workers.start("--encoders", str(engine_ffmpeg(site)))
    url = worker.uds_url
    on = run(site, worker.outputs / "on", [*ROUTED, *LEFT, "streamed"],
             FRAMEWIRE_INTEGRATIONS="sglang", FRAMEWIRE_URL=url)  # fmt: skip
    assert on["hooked"] == dict.fromkeys(CHECKED, True)
    assert on["results"] == own["results"]
    # Encode while decoding: CPU frames are not its (None, as SGLang answers); chunks of
    # the clip through the stream session give the whole clip's bytes.
    assert on["streamed-cpu"] is None
    assert on["streamed"] == own["results"]["streamed-whole"][0]
    assert "ValueError" in on["results"]["bad-quality"]["error"]  # SGLang's own refusal
    # Every routed case went to the worker (the parallel pair in one request, the uint8
    # tensor through SGLang's materialized frames); the others ran SGLang's code.
    assert on["counts"]["sglang:routed"] == len(ROUTED) + 1 + 1  # + uint8, + streamed
    assert on["counts"]["sglang:engine:frames of torch.uint8"] == 1
    assert on["counts"]["sglang:engine:frames not on a CUDA device"] == 1
    assert "framewire: SGLang's _try_save_cuda_video_direct" in on["log"]
    assert sorted(p.name for p in (worker.outputs / "on").iterdir()) == sorted(
        [f"{n}-{i}.mp4" for n in ROUTED + LEFT if n != "bad-quality"
         for i in range(2 if n == "two-outputs" else 1)] + ["streamed.mp4"]
    )  # fmt: skip


def test_a_worker_without_sglangs_encoder_leaves_it_to_sglang(site, own, workers):
    worker = workers.start()  # only the test environment's ffmpeg (9.x)
    on = run(site, worker.outputs / "on", ["float32", "bf16-audio"],
             FRAMEWIRE_INTEGRATIONS="sglang", FRAMEWIRE_URL=worker.uds_url)  # fmt: skip
    assert on["results"] == {n: own["results"][n] for n in ("float32", "bf16-audio")}
    # Each refused twice: SGLang's direct save, then its materialized one (bf16-audio's
    # materialized save writes a WAV first: not routed).
    assert on["counts"] == {"sglang:engine:the worker answered encoder_unavailable": 3,
                            "sglang:engine:audio from a WAV file": 1}  # fmt: skip
    assert on["log"].count("encoder_unavailable") == 1  # said once
    with worker.http() as http:  # and counted by the worker
        text = http.get("/metrics").text
    assert 'framewire_encoder_unavailable_total{kind="encode"} 3.0' in text


def test_no_worker_leaves_it_to_sglang(site, own, tmp_path):
    on = run(site, tmp_path / "on", ["float32", "two-outputs"], FRAMEWIRE_INTEGRATIONS="sglang",
             FRAMEWIRE_URL=f"http://127.0.0.1:{free_port()}")  # fmt: skip
    assert on["results"] == {n: own["results"][n] for n in ("float32", "two-outputs")}
    assert set(on["counts"]) == {"sglang:engine:the worker answered unavailable"}


def test_a_path_outside_the_roots_leaves_it_to_sglang(site, own, workers, tmp_path):
    worker: Worker = workers.start("--encoders", str(engine_ffmpeg(site)))
    on = run(site, tmp_path / "elsewhere", ["float32"], FRAMEWIRE_INTEGRATIONS="sglang",
             FRAMEWIRE_URL=worker.uds_url)  # fmt: skip
    assert on["results"]["float32"] == own["results"]["float32"]
    # Declined twice: SGLang's direct save, then its materialized one.
    assert on["counts"] == {"sglang:engine:the path is outside the worker's output roots": 2}


# --- MiniMax-H3's reference decode, shared across two gloo ranks -----------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    """A reference video, and a PATH directory whose ``ffmpeg`` is the test's (SGLang
    decodes references with the ffmpeg on PATH)."""
    root = tmp_path_factory.mktemp("h3")
    video = root / "ref.mp4"
    subprocess.run([FFMPEG, "-v", "error", "-f", "lavfi", "-i", "testsrc=size=80x60:rate=25",
                    "-t", "1.2", "-pix_fmt", "yuv420p", str(video)], check=True)  # fmt: skip
    (root / "bin").mkdir()
    (root / "bin" / "ffmpeg").symlink_to(FFMPEG)
    return video, root / "bin"


def h3(site: Path, reference: tuple[Path, Path], out: Path, video: Path, **env: str) -> list:
    """Two ranks of SGLang's shared decode; each rank's report."""
    path_dir = reference[1]
    env = {"PATH": f"{path_dir}:{os.environ['PATH']}", **env}
    port = free_port()
    out.mkdir(parents=True, exist_ok=True)
    procs = [
        start_engine(site, "engine_sglang", "h3", str(rank), "2", str(port), str(video),
                     str(out / f"rank{rank}.json"),
                     stdio=(os.devnull, os.devnull, str(out / f"rank{rank}.log")), **env)
        for rank in range(2)
    ]  # fmt: skip
    for rank, p in enumerate(procs):
        assert p.wait(timeout=300) == 0, (out / f"rank{rank}.log").read_text()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_minimax_h3_reference_decode_once_in_the_worker(site, reference, workers, tmp_path):
    own = h3(site, reference, tmp_path / "own", reference[0])
    assert own[0]["sha256"] == own[1]["sha256"] and own[0]["shape"] == [10, 48, 64, 3]
    assert own[0]["counts"] == {}

    worker = workers.start()  # decodes with the test's ffmpeg: the one on SGLang's PATH
    video = worker.inputs / "ref.mp4"
    shutil.copy(reference[0], video)
    on = h3(site, reference, tmp_path / "on", video, FRAMEWIRE_INTEGRATIONS="sglang",
            FRAMEWIRE_URL=worker.uds_url, FRAMEWIRE_FD_SOCKET=str(worker.fd_socket))  # fmt: skip
    assert [r["sha256"] for r in on] == [own[0]["sha256"]] * 2
    assert [r["counts"] for r in on] == [{"sglang:routed": 1}] * 2
    with worker.http() as http:
        assert metric(http, "framewire_decodes_total") == 1  # one decode for both ranks


def test_a_worker_decoding_with_another_ffmpeg_leaves_it_to_sglang(site, reference, workers,
                                                                   tmp_path):  # fmt: skip
    own = h3(site, reference, tmp_path / "own", reference[0])
    worker = workers.start("--decode-ffmpeg", str(engine_ffmpeg(site)))  # 4.2.2, not PATH's
    video = worker.inputs / "ref.mp4"
    shutil.copy(reference[0], video)
    on = h3(site, reference, tmp_path / "on", video, FRAMEWIRE_INTEGRATIONS="sglang",
            FRAMEWIRE_URL=worker.uds_url, FRAMEWIRE_FD_SOCKET=str(worker.fd_socket))  # fmt: skip
    assert [r["sha256"] for r in on] == [own[0]["sha256"]] * 2  # SGLang's own, on both ranks
    assert [r["counts"] for r in on] == [
        {"sglang:engine:the worker answered encoder_unavailable": 1}] * 2  # fmt: skip
    with worker.http() as http:
        text = http.get("/metrics").text
    assert 'framewire_encoder_unavailable_total{kind="decode"} 2.0' in text


def test_no_worker_and_the_local_route_give_sglangs_bytes(site, own, tmp_path):
    """FRAMEWIRE_LOCAL_FALLBACK=1: with no worker, framewire encodes in SGLang's process,
    with SGLang's own ffmpeg (the local encoder runs the binary of SGLang's pins)."""
    cases = ["float32", "bf16-audio", "two-outputs"]
    nobody = f"http://127.0.0.1:{free_port()}"
    on = run(site, tmp_path / "on", cases, FRAMEWIRE_INTEGRATIONS="sglang", FRAMEWIRE_URL=nobody,
             FRAMEWIRE_LOCAL_FALLBACK="1")  # fmt: skip
    assert on["results"] == {n: own["results"][n] for n in cases}
    assert on["counts"] == {"sglang:routed": 3}


# --- every version of the range, drift, versions outside it, failures of framewire's ---


@pytest.fixture(scope="module")
def sglang_worker(site, tmp_path_factory) -> Iterator[Worker]:
    """One worker with SGLang's encoder for the module's runs at every version."""
    started = Workers(lambda: tmp_path_factory.mktemp("sglang-worker"))
    yield started.start("--encoders", str(engine_ffmpeg(site)))
    started.stop_all()


SMOKE = ["float32", "bf16-audio", "pair"]
# What each version has of the targets, once hooked (0.5.21: no _save_video_ffmpeg, no
# CudaVideoEncoder).
HAS = {"0.5.21": [HOOKED[0], HOOKED[1], CHECKED[-1]], "0.5.22": CHECKED, "0.5.23": CHECKED}
# A copy of SGLang's utils where one target was renamed (its definition and its calls) and
# another takes one more parameter.
DRIFT = (
    ("_try_save_cuda_video_direct", "_try_save_cuda_video_direct_v2"),
    ("    save_file_paths: Sequence[str],\n    *,\n",
     "    save_file_paths: Sequence[str],\n    *,\n    parallelism: int = 2,\n"),
)  # fmt: skip


def warnings(log: str) -> list[str]:
    return lines(log, "framewire.integrations WARNING")


@pytest.mark.parametrize("version", VERSIONS["sglang"])
def test_each_version_routes_what_it_verified_and_leaves_a_drifted_target(
    version, sglang_worker, tmp_path
):
    site = engine_site("sglang", version)
    on_env = {"FRAMEWIRE_INTEGRATIONS": "sglang", "FRAMEWIRE_URL": sglang_worker.uds_url}
    own = run(site, tmp_path / "own", SMOKE)
    assert all(isinstance(r, list) for r in own["results"].values()), own["results"]
    on = run(site, sglang_worker.outputs / version, SMOKE, **on_env)
    assert on["results"] == own["results"]
    assert on["hooked"] == dict.fromkeys(HAS[version], True)
    assert on["counts"] == {"sglang:routed": 3}  # the pair in one parallel save
    assert warnings(on["log"]) == []

    # SGLang's module drifted: each drifted target is left to SGLang, with one line
    # naming the version and the target; the others are still hooked.
    root = overlay(tmp_path / "overlay", site, UTILS_FILE, *DRIFT)
    drifted = run(site, sglang_worker.outputs / f"{version}-drift", SMOKE,
                  FRAMEWIRE_TEST_OVERLAY=str(root), **on_env)  # fmt: skip
    assert drifted["results"] == own["results"]
    kept = [n for n in HAS[version] if n not in HOOKED[:2]]
    assert drifted["hooked"] == dict.fromkeys(kept, True)
    said = warnings(drifted["log"])
    assert len(said) == 2 and all(f"SGLang {version}: " in line for line in said), said
    assert "_try_save_cuda_video_direct is missing" in said[0]
    assert (
        "_try_save_cuda_videos_direct has the parameters (samples, save_file_paths, *, "
        "parallelism=2" in said[1]
    )
    if version == "0.5.21":  # nothing else to hook: every save is SGLang's own
        assert drifted["counts"] == {}
    else:  # the materialized frames go through _save_video_ffmpeg, still hooked
        assert drifted["counts"] == {"sglang:routed": 3,
                                     "sglang:engine:audio from a WAV file": 1}  # fmt: skip


def test_a_version_outside_the_range_is_left_to_sglang_unless_asked(
    site, own, sglang_worker, tmp_path
):
    newer = [fake_version(tmp_path / "meta", "sglang", "0.5.24"), site]
    on_env = {"FRAMEWIRE_INTEGRATIONS": "sglang", "FRAMEWIRE_URL": sglang_worker.uds_url}
    left = run(newer, sglang_worker.outputs / "newer", ["float32"], **on_env)
    assert left["results"]["float32"] == own["results"]["float32"]
    assert (left["hooked"], left["counts"]) == ({}, {})
    [said] = warnings(left["log"])
    assert "SGLang 0.5.24 is outside the versions verified (0.5.21-0.5.23)" in said
    # Asked for (the probe finds every target as 0.5.22 and 0.5.23 have them): routed.
    asked = run(newer, sglang_worker.outputs / "asked", ["float32"],
                FRAMEWIRE_INTEGRATIONS_UNVERIFIED="1", **on_env)  # fmt: skip
    assert asked["results"]["float32"] == own["results"]["float32"]
    assert asked["hooked"] == dict.fromkeys(CHECKED, True)
    assert asked["counts"] == {"sglang:routed": 1}


@pytest.mark.parametrize("stage", STAGES)
def test_a_failure_of_framewires_at_any_stage_leaves_sglang_running(
    site, own, sglang_worker, stage
):
    on = run(site, sglang_worker.outputs / stage, ["float32", "two-outputs"],
             FRAMEWIRE_INTEGRATIONS="sglang", FRAMEWIRE_URL=sglang_worker.uds_url,
             FRAMEWIRE_TEST_INJECT=stage)  # fmt: skip
    assert on["results"] == {n: own["results"][n] for n in ("float32", "two-outputs")}
    said = warnings(on["log"])
    assert len(said) == 1 and "injected failure\\nframewire: FORGED LINE" in said[0], said
    assert not lines(on["log"], "Traceback") and not [
        line for line in on["log"].splitlines() if line.startswith("framewire: FORGED")
    ]
    expected = {
        "probe": ({}, {}),
        "register": ({}, {}),
        "check": (dict.fromkeys(CHECKED, True), {"sglang:routed": 2}),
        # Each save fails in framewire and runs SGLang's own: the direct save, then the
        # materialized one (1 + 1); the parallel one, then each output's two (1 + 2 + 2).
        "save": (dict.fromkeys(CHECKED, True),
                 {"sglang:engine:framewire failed (RuntimeError)": 7}),
    }  # fmt: skip
    assert (on["hooked"], on["counts"]) == expected[stage]
