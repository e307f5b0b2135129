"""diffusers 0.42.1's own ``export_to_video`` against the drop-in, through a real worker:
the same sha256 for every save routed, diffusers' own function for the rest."""

from __future__ import annotations

import hashlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import framewire.integrations as integrations
import numpy as np
import pytest
from framewire.integrations import diffusers as fw_diffusers
from PIL import Image

from tests.support.engine_site import VERSIONS, engine_site, fake_version, overlay, run_engine
from tests.support.engines import diffusers_export_utils
from tests.support.worker import Worker, Workers


@pytest.fixture(scope="module", autouse=True)
def export_utils() -> ModuleType:
    """diffusers' own module, imported before any of these tests (and the drop-in) use it."""
    return diffusers_export_utils()


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def floats(seed: int, t: int, h: int, w: int, dtype=np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.random((h, w, 3)) * 1.3 - 0.15).astype(dtype) for _ in range(t)]  # wraps


@pytest.fixture
def on(workers, monkeypatch):
    worker = workers.start()
    monkeypatch.setenv("FRAMEWIRE_URL", worker.uds_url)
    return worker


def test_the_drop_in_has_diffusers_signature(export_utils):
    def shape(fn):  # names, kinds and defaults: what a caller can pass
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert shape(fw_diffusers.export_to_video) == shape(export_utils.export_to_video)


def test_install_rebinds_diffusers_name_and_uninstall_puts_it_back(export_utils):
    import diffusers.utils

    own = export_utils.export_to_video
    fw_diffusers.install()
    try:
        assert diffusers.utils.export_to_video is fw_diffusers.export_to_video
        assert export_utils.export_to_video is fw_diffusers.export_to_video
    finally:
        fw_diffusers.uninstall()
    assert diffusers.utils.export_to_video is own and export_utils.export_to_video is own


@pytest.mark.parametrize(("name", "frames", "fps"), [
    ("float32", floats(1, 10, 48, 64), 8),
    ("odd-size", floats(2, 7, 35, 51), 24),
    ("23.976", floats(3, 6, 32, 48), 23.976),
    ("pil", [Image.fromarray((f.clip(0, 1) * 255).astype(np.uint8)) for f in floats(4, 6, 40, 40)],
     10),
])  # fmt: skip
def test_routed_saves_have_diffusers_bytes(on, export_utils, tmp_path, name, frames, fps):
    before = integrations.counts().get("diffusers:routed", 0)
    path = str(on.outputs / f"{name}.mp4")
    assert fw_diffusers.export_to_video(frames, path, fps=fps) == path
    assert integrations.counts()["diffusers:routed"] == before + 1
    own = export_utils.export_to_video(frames, str(tmp_path / "own.mp4"), fps=fps)
    assert sha(path) == sha(own)


@pytest.mark.parametrize(("why", "frames", "kw"), [
    ("frames that are not float32 arrays", floats(5, 4, 32, 32, np.float64), {}),
    ("a bitrate, a macro block size or no quality", floats(6, 4, 32, 32), {"bitrate": 500000}),
])  # fmt: skip
def test_other_saves_run_diffusers_own(on, export_utils, tmp_path, why, frames, kw):
    key = f"diffusers:engine:{why}"
    before = integrations.counts().get(key, 0)
    path = str(on.outputs / "left.mp4")
    assert fw_diffusers.export_to_video(frames, path, fps=8, **kw) == path
    assert integrations.counts()[key] == before + 1
    own = export_utils.export_to_video(frames, str(tmp_path / "own.mp4"), fps=8, **kw)
    assert sha(path) == sha(own)


def test_no_path_is_a_temporary_file_as_in_diffusers(on, export_utils, tmp_path):
    """No path: left to diffusers (a temporary file of its own naming), counted as such,
    with diffusers' bytes."""
    import os
    import tempfile

    key = "diffusers:engine:no output path (a temporary file)"
    before = integrations.counts().get(key, 0)
    frames = floats(7, 3, 16, 16)
    path = fw_diffusers.export_to_video(frames)
    try:
        assert path.endswith(".mp4") and os.path.dirname(path) == tempfile.gettempdir()
        assert integrations.counts()[key] == before + 1
        own = export_utils.export_to_video(frames, str(tmp_path / "own.mp4"))
        assert sha(path) == sha(own)
    finally:
        os.unlink(path)


# --- every version of the range, drift, versions outside it, failures, a real pipeline ---
# diffusers' own code in its own process (tests/support/engine_diffusers.py): each case
# saved by diffusers' export_to_video and by the drop-in, in the same process.


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Iterator[Worker]:
    started = Workers(lambda: tmp_path_factory.mktemp("diffusers-worker"))
    yield started.start()
    started.stop_all()


def run(sites: list[Path], out: Path, names: list[str], **env: str) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    return run_engine(sites, "engine_diffusers", str(out), *names, **env)


def warnings(log: str) -> list[str]:
    return [line for line in log.splitlines() if "framewire.integrations WARNING" in line]


EXPORT_FILE = "diffusers/utils/export_utils.py"
# diffusers' export_to_video with one more parameter.
DRIFT = ("    macro_block_size: int | None = 16,\n) -> str:",
         "    macro_block_size: int | None = 16,\n    audio=None,\n) -> str:")  # fmt: skip
LEFT_FLOAT64 = "diffusers:engine:frames that are not float32 arrays"


@pytest.mark.parametrize("version", VERSIONS["diffusers"])
def test_each_version_routes_and_leaves_a_drifted_function(version, shared, tmp_path):
    site = engine_site("diffusers", version)
    on = run([site], shared.outputs / version, ["float32", "pil", "float64"],
             FRAMEWIRE_URL=shared.uds_url)  # fmt: skip
    assert on["version"] == version
    assert on["on"] == on["own"]
    assert on["counts"] == {"diffusers:routed": 2, LEFT_FLOAT64: 1}
    assert warnings(on["log"]) == []
    root = overlay(tmp_path / "overlay", site, EXPORT_FILE, DRIFT)
    drifted = run([site], shared.outputs / f"{version}-drift", ["float32"],
                  FRAMEWIRE_URL=shared.uds_url, FRAMEWIRE_TEST_OVERLAY=str(root))  # fmt: skip
    assert drifted["on"] == drifted["own"] == {"float32": on["own"]["float32"]}
    assert drifted["counts"] == {
        "diffusers:engine:a diffusers version or export_to_video not verified": 1
    }
    [said] = warnings(drifted["log"])
    assert (
        f"diffusers {version}: diffusers.utils.export_utils.export_to_video has the "
        "parameters (video_frames, output_video_path=None, fps=10, quality=5.0, bitrate=None, "
        "macro_block_size=16, audio=None)" in said
    )


def test_a_version_outside_the_range_is_left_to_diffusers(shared, tmp_path):
    newer = [fake_version(tmp_path / "meta", "diffusers", "0.43.0")]
    left = run(newer, shared.outputs / "newer", ["float32"], FRAMEWIRE_URL=shared.uds_url)
    assert left["on"] == left["own"]
    assert left["counts"] == {
        "diffusers:engine:a diffusers version or export_to_video not verified": 1
    }
    [said] = warnings(left["log"])
    assert "diffusers 0.43.0 is outside the versions verified (0.38.0-0.42.1)" in said
    asked = run(newer, shared.outputs / "asked", ["float32"], FRAMEWIRE_URL=shared.uds_url,
                FRAMEWIRE_INTEGRATIONS_UNVERIFIED="1")  # fmt: skip
    assert asked["on"] == asked["own"] and asked["counts"] == {"diffusers:routed": 1}


@pytest.mark.parametrize("stage", ["probe", "save"])
def test_a_failure_of_framewires_leaves_diffusers_running(shared, stage):
    on = run([], shared.outputs / stage, ["float32", "pil"], FRAMEWIRE_URL=shared.uds_url,
             FRAMEWIRE_TEST_INJECT=stage)  # fmt: skip
    assert on["on"] == on["own"]
    [said] = warnings(on["log"])
    assert "injected failure\\nframewire: FORGED LINE" in said
    assert not [line for line in on["log"].splitlines() if line.startswith("framewire: FORGED")]
    why = {"probe": "a diffusers version or export_to_video not verified",
           "save": "framewire failed (RuntimeError)"}[stage]  # fmt: skip
    assert on["counts"] == {f"diffusers:engine:{why}": 2}


def test_a_real_pipeline_saved_three_ways_has_one_sha256(shared):
    """A tiny WanPipeline built in code (random weights, nothing downloaded), 2 steps on
    CPU: its frames saved by diffusers' own export_to_video, by the drop-in, and at the
    usual call site after install(); the last two written by the worker."""
    out = shared.outputs / "pipeline"
    with shared.http() as http:
        before = written(http)
        report = run([engine_site("pipeline")], out, ["pipeline"], FRAMEWIRE_URL=shared.uds_url)
        assert written(http) == before + 2
    assert report["frames"] == [9, 32, 48, 3]
    assert report["on"]["pipeline"] == report["own"]["pipeline"] == report["installed"]
    assert report["rebound"] is True
    assert report["counts"] == {"diffusers:routed": 2}


def written(http) -> float:
    """The outputs a worker wrote."""
    found = re.search(r'^framewire_outputs_total\{result="ok"\} (\S+)$', http.get("/metrics").text,
                      re.MULTILINE)  # fmt: skip
    return float(found.group(1)) if found else 0.0
