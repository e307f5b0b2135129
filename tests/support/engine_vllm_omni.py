"""Run in vLLM-omni's own environment (tests/support/engine_site.py): vLLM-omni's own
plugin loader (0.26.0 to 0.30.0), its chunked pre-encode (``ChunkedVideoMP4Session``,
0.30 on) and its one-shot ``_encode_video_bytes`` on cases named here; prints the
sha256 of each MP4 they return.

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
import time
import types
from importlib.metadata import entry_points
from typing import Any

from tests.support.engine_faults import inject_failure
from tests.support.engine_site import enter_shells, use_sites

SHELLS = ("vllm_omni", "vllm_omni.diffusion", "vllm_omni.diffusion.models",
          "vllm_omni.diffusion.utils", "vllm_omni.entrypoints", "vllm_omni.entrypoints.openai",
          "vllm_omni.entrypoints.openai.protocol")  # fmt: skip
API = "vllm_omni.entrypoints.openai.video_api_utils"
# What video_api_utils imports for reading reference inputs, never on the encode path.
API_STUBS = {
    "vllm.multimodal": {},
    "vllm.multimodal.video": {
        "VIDEO_LOADER_REGISTRY": types.SimpleNamespace(register=lambda name: lambda cls: cls),
        "VideoBackend": type("VideoBackend", (), {}),
        "VideoSourceMetadata": object,
        "VideoTargetMetadata": object,
    },
    "vllm_omni.entrypoints.openai.errors": {"InvalidInputReferenceError": ValueError},
    "vllm_omni.entrypoints.openai.protocol.videos": {
        name: object
        for name in (
            "FileImageReference",
            "FileVideoReference",
            "ImageReference",
            "UrlImageReference",
            "UrlVideoReference",
            "VideoReference",
        )
    },
}
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


class _Logger(logging.Logger):
    """vLLM's logger: the standard one, with its ``*_once`` methods."""

    def _once(self, level: int, msg: str, *args: Any) -> None:
        key = (level, msg)
        if key not in self.__dict__.setdefault("said", set()):
            self.__dict__["said"].add(key)
            self.log(level, msg, *args)

    def info_once(self, msg: str, *args: Any, **kw: Any) -> None:
        self._once(logging.INFO, msg, *args)

    def warning_once(self, msg: str, *args: Any, **kw: Any) -> None:
        self._once(logging.WARNING, msg, *args)

    def debug_once(self, msg: str, *args: Any, **kw: Any) -> None:
        self._once(logging.DEBUG, msg, *args)


def _logger(name: str) -> logging.Logger:
    logging.setLoggerClass(_Logger)
    try:
        return logging.getLogger(name)
    finally:
        logging.setLoggerClass(logging.Logger)


def enter_vllm_omni() -> None:
    enter_shells("vllm_omni", SHELLS)
    vllm = types.ModuleType("vllm")
    vllm.__path__ = []
    sys.modules["vllm"] = vllm
    for name, attrs in {
        "vllm.envs": {"VLLM_PLUGINS": _allowed()},
        "vllm.logger": {"init_logger": _logger},
        "vllm.plugins": {"load_general_plugins": _load_general_plugins},
        **API_STUBS,
    }.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        if name.count(".") == 1 and name.startswith("vllm."):
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
        "no-codec-options": (_chunks(8, 1, 6, 96, 160, 3), {"value_range": (0.0, 1.0), "fps": 8}),
        # The encoder alone, fed the uint8 chunks a session quantized on a GPU would give it.
        "encoder-uint8": (_chunks(9, 1, 10, 48, 64, 4), {
            "value_range": (-1.0, 1.0), "fps": 24,
            "video_codec_options": {"preset": "ultrafast", "threads": "1"}}),
    }  # fmt: skip


def byte_cases() -> dict[str, tuple[Any, dict[str, Any]]]:
    """name: (video, _encode_video_bytes keywords): the one-shot route, bytes back."""
    import numpy as np
    import torch
    from PIL import Image

    rng = np.random.default_rng(11)
    floats = (rng.random((8, 48, 64, 3)) * 1.4 - 0.2).astype(np.float32)
    big = rng.random((6, 384, 640, 3), dtype=np.float32)  # x264's threads matter at this size
    ultrafast = {"preset": "ultrafast", "threads": "1"}
    return {
        "bytes-float32-audio": (floats, {"fps": 24, "audio": _wave(12, (2, 12000)),
                                         "video_codec_options": ultrafast}),
        "bytes-uint8": ((floats.clip(0, 1) * 255).astype(np.uint8), {"fps": 12.5}),
        "bytes-big-no-options": (big, {"fps": 24}),
        "bytes-tensor": (torch.from_numpy(floats.copy()).permute(0, 3, 1, 2),
                         {"fps": 16, "video_codec_options": {"preset": "fast", "threads": "2"}}),
        "bytes-pil": ([Image.fromarray(f) for f in (floats.clip(0, 1) * 255).astype(np.uint8)],
                      {"fps": 8, "audio": _wave(13, (16000,)), "audio_sample_rate": 16000}),
        "bytes-crf": (floats, {"fps": 24, "video_codec_options": {"crf": "23"}}),
    }  # fmt: skip


def main() -> None:
    use_sites()
    names = sys.argv[1:]
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    enter_vllm_omni()
    import importlib

    media = importlib.import_module(MEDIA)
    api = importlib.import_module(API)
    # 0.30 on: the chunked pre-encode (0.26 and 0.28 have neither module nor class).
    chunked = importlib.import_module(CHUNKED) if hasattr(media, "ChunkedMP4Encoder") else None
    originals = {"bytes": api._encode_video_bytes}
    if chunked is not None:
        originals |= {
            "media": media.ChunkedMP4Encoder,
            "chunked": chunked.ChunkedMP4Encoder,
            "session": chunked.ChunkedVideoMP4Session,
        }
    inject_failure(os.environ.get("FRAMEWIRE_TEST_INJECT"))
    plugins = importlib.import_module("vllm_omni.plugins")
    plugins.load_omni_general_plugins()
    import framewire.integrations as integrations
    import framewire.integrations.vllm_omni as fw_vllm_omni

    now = {"bytes": api._encode_video_bytes}
    if chunked is not None:
        now |= {
            "media": media.ChunkedMP4Encoder,
            "chunked": chunked.ChunkedMP4Encoder,
            "session": chunked.ChunkedVideoMP4Session,
        }
    report: dict[str, Any] = {
        "unchanged": {k: now[k] is v for k, v in originals.items()},
        "hooked": fw_vllm_omni.hooked(),
        "results": {},
        "seconds": {},
    }
    every = {**byte_cases(), **cases()}
    for name in names:
        video, kw = every[name]
        started = time.monotonic()
        try:
            if name.startswith("bytes-"):
                videos = [api._encode_video_bytes(video, **kw)]
            elif name.startswith("encoder-"):
                assert chunked is not None, f"{name}: no chunked pre-encode in this version"
                videos = [chunked_encoder(chunked, video, kw)]
            else:
                assert chunked is not None, f"{name}: no chunked pre-encode in this version"
                QUANTIZED[name] = 0
                videos = chunked_session(chunked, video, kw)
            report["results"][name] = [hashlib.sha256(v).hexdigest() for v in videos]
        except Exception as exc:
            report["results"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        report["seconds"][name] = time.monotonic() - started
    report["counts"] = integrations.counts()
    report["quantized"] = QUANTIZED
    print(json.dumps(report))


QUANTIZED: dict[str, int] = {}  # by case: the chunks vLLM-omni quantized in this process


def chunked_session(chunked: Any, chunks: list[Any], kw: dict[str, Any]) -> list[bytes]:
    """vLLM-omni's ChunkedVideoMP4Session fed ``chunks``: one MP4 per batch entry (the
    chunks it quantized here counted in QUANTIZED under the last key)."""
    own = chunked.quantize_chunk
    key = next(reversed(QUANTIZED))

    def counted(*args: Any, **kwargs: Any) -> Any:
        QUANTIZED[key] += 1
        return own(*args, **kwargs)

    chunked.quantize_chunk = counted
    session = chunked.ChunkedVideoMP4Session(**kw)
    try:
        for chunk in chunks:
            session.push(chunk)
        return list(session.finish())
    except BaseException:
        session.abort()
        raise
    finally:
        chunked.quantize_chunk = own


def chunked_encoder(chunked: Any, chunks: list[Any], kw: dict[str, Any]) -> bytes:
    """vLLM-omni's ChunkedMP4Encoder fed ``chunks`` as its session would give them once
    quantized (entry 0, (T, H, W, 3) uint8)."""
    frames = [chunked.quantize_chunk(c, kw["value_range"])[0].numpy() for c in chunks]
    encoder = chunked.ChunkedMP4Encoder(
        width=frames[0].shape[2],
        height=frames[0].shape[1],
        fps=kw["fps"],
        video_codec_options=kw["video_codec_options"],
    )
    try:
        for chunk in frames:
            encoder.push(chunk)
        data: bytes = encoder.finish()
    except BaseException:
        encoder.abort()
        raise
    return data


if __name__ == "__main__":
    main()
