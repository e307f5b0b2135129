"""Run in vLLM-omni's own environment (tests/support/engine_site.py): vLLM-omni 0.30.0's
plugin loader and its chunked pre-encode (``ChunkedVideoMP4Session``) on cases named
here; prints the sha256 of each MP4 it returns.

``python -m tests.support.engine_vllm_omni CASE...``. vLLM itself is not installed (its
wheel is a GPU runtime): ``vllm.envs`` (``VLLM_PLUGINS``), ``vllm.logger`` and
``vllm.plugins.load_general_plugins`` (vLLM's group, under the same allow-list) are
stubs; vLLM-omni's packages are entered as path-only shells. ``load_omni_general_plugins``,
``chunked_video`` and ``media_utils`` are vLLM-omni's own files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import types
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

SHELLS = ("vllm_omni", "vllm_omni.diffusion", "vllm_omni.diffusion.models",
          "vllm_omni.diffusion.utils")  # fmt: skip
MEDIA = "vllm_omni.diffusion.utils.media_utils"
CHUNKED = "vllm_omni.diffusion.utils.chunked_video"


def _allowed() -> list[str] | None:
    raw = os.environ.get("VLLM_PLUGINS")
    return None if raw is None else [p.strip() for p in raw.split(",") if p.strip()]


def _load_general_plugins() -> None:
    """vLLM's: every ``vllm.general_plugins`` entry point VLLM_PLUGINS allows, called."""
    allowed = _allowed()
    for plugin in entry_points(group="vllm.general_plugins"):
        if allowed is None or plugin.name in allowed:
            plugin.load()()


def enter_vllm_omni() -> None:
    [site] = [p for p in sys.path if (Path(p) / "vllm_omni").is_dir()][:1]
    for name in SHELLS:
        mod = types.ModuleType(name)
        mod.__path__ = [os.path.join(site, *name.split("."))]
        sys.modules[name] = mod
    vllm = types.ModuleType("vllm")
    vllm.__path__ = []
    sys.modules["vllm"] = vllm
    for name, attrs in {
        "vllm.envs": {"VLLM_PLUGINS": _allowed()},
        "vllm.logger": {"init_logger": logging.getLogger},
        "vllm.plugins": {"load_general_plugins": _load_general_plugins},
    }.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        setattr(vllm, name.split(".")[1], mod)


def _chunks(seed: int, batch: int, frames: int, h: int, w: int, step: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    clip = torch.rand(batch, 3, frames, h, w, generator=g) * 2.4 - 1.2  # past (-1, 1) too
    return [clip[:, :, t0 : t0 + step] for t0 in range(0, frames, step)]


def _wave(seed: int, shape: tuple[int, ...]) -> Any:
    import numpy as np

    return (np.random.default_rng(seed).standard_normal(shape) * 0.3).astype(np.float32)


def cases() -> dict[str, tuple[list[Any], dict[str, Any]]]:
    """name: (chunks, ChunkedVideoMP4Session keywords)."""
    return {
        "wan-ultrafast": (_chunks(1, 1, 12, 48, 64, 4), {
            "value_range": (-1.0, 1.0), "fps": 16,
            "video_codec_options": {"preset": "ultrafast", "threads": "0"}}),
        "minimax-fast-2-threads": (_chunks(2, 1, 9, 40, 56, 3), {
            "value_range": (0.0, 1.0), "fps": 23.976,
            "video_codec_options": {"preset": "fast", "threads": "2"}}),
        "batch-with-audio": (_chunks(3, 2, 8, 32, 48, 4), {
            "value_range": (-1.0, 1.0), "fps": 24, "audio_sample_rate": 24000,
            "audio_waveforms": [_wave(4, (2, 8000)), None],
            "video_codec_options": {"preset": "ultrafast", "threads": "1"}}),
        "mono-default-rate": (_chunks(5, 1, 6, 32, 32, 6), {
            "value_range": (-1.0, 1.0), "fps": 8, "audio_waveforms": [_wave(6, (44100,))],
            "video_codec_options": {"preset": "ultrafast", "threads": "1"}}),
        "odd-size": (_chunks(7, 1, 4, 31, 33, 4), {"value_range": (-1.0, 1.0), "fps": 8}),
    }  # fmt: skip


def main() -> None:
    names = sys.argv[1:]
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    enter_vllm_omni()
    import importlib

    media = importlib.import_module(MEDIA)
    chunked = importlib.import_module(CHUNKED)
    original = media.ChunkedMP4Encoder
    plugins = importlib.import_module("vllm_omni.plugins")
    plugins.load_omni_general_plugins()
    import framewire.integrations as integrations

    report: dict[str, Any] = {
        "unchanged": [m.ChunkedMP4Encoder is original for m in (media, chunked)],
        "results": {},
    }
    every = cases()
    for name in names:
        chunks, kw = every[name]
        session = chunked.ChunkedVideoMP4Session(**kw)
        try:
            for chunk in chunks:
                session.push(chunk)
            videos = session.finish()
            report["results"][name] = [hashlib.sha256(v).hexdigest() for v in videos]
        except Exception as exc:
            session.abort()
            report["results"][name] = {"error": f"{type(exc).__name__}: {exc}"}
    report["counts"] = integrations.counts()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
