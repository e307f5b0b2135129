"""diffusers 0.42.1's own ``export_to_video`` against the drop-in, through a real worker:
the same sha256 for every save routed, diffusers' own function for the rest."""

from __future__ import annotations

import hashlib
import inspect
from types import ModuleType

import framewire.integrations as integrations
import numpy as np
import pytest
from framewire.integrations import diffusers as fw_diffusers
from PIL import Image

from tests.support.engines import diffusers_export_utils


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


def test_no_path_is_a_temporary_file_as_in_diffusers(on):
    path = fw_diffusers.export_to_video(floats(7, 3, 16, 16))
    try:
        assert path.endswith(".mp4") and sha(path)
    finally:
        import os

        os.unlink(path)
