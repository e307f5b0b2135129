"""Run in diffusers' own environment (tests/support/engine_site.py): diffusers' own
``export_to_video`` (0.38.0 to 0.42.1) against framewire's drop-in and ``install()``,
on cases named here; prints the sha256 of each file.

``python -m tests.support.engine_diffusers OUT_DIR CASE...``: each case saved by
diffusers' own function (``own``), by the drop-in (``on``) and, for ``pipeline``, at the
usual call site after ``install()`` (``installed``). ``pipeline``: a tiny text-to-video
pipeline (``WanPipeline``) built in code from configs with random weights (its
tokenizer a word-level one built in code: nothing is downloaded), 2 steps on CPU; its
``.frames`` are the frames saved.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from tests.support.engine_faults import inject_failure
from tests.support.engine_site import OVERLAY_ENV, use_sites

EXPORT = "diffusers.utils.export_utils"


def _floats(seed: int, t: int, h: int, w: int, dtype: str = "float32") -> list[Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [(rng.random((h, w, 3)) * 1.3 - 0.15).astype(dtype) for _ in range(t)]  # wraps


def cases() -> dict[str, tuple[Any, dict[str, Any]]]:
    """name: (frames, export_to_video keywords)."""
    import numpy as np
    from PIL import Image

    pil = [Image.fromarray((f.clip(0, 1) * 255).astype(np.uint8)) for f in _floats(4, 6, 40, 40)]
    return {
        "float32": (_floats(1, 10, 48, 64), {"fps": 8}),
        "odd-size": (_floats(2, 7, 35, 51), {"fps": 24}),
        "pil": (pil, {"fps": 10}),
        "float64": (_floats(5, 4, 32, 32, "float64"), {"fps": 8}),  # left to diffusers
    }


def pipeline_frames() -> Any:
    """The frames of a tiny WanPipeline, built from configs with random weights."""
    import torch
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])  # fmt: skip
    text = UMT5EncoderModel(UMT5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=37, num_layers=2,
                                       num_heads=4, relative_attention_num_buckets=8))  # fmt: skip
    words = ["<pad>", "</s>", "<unk>", "a", "cat", "walks", "on", "the", "grass", "sunny", "day"]
    vocab = {w: i for i, w in enumerate(words)}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="<pad>",
                                        eos_token="</s>", unk_token="<unk>")  # fmt: skip
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    pipe = WanPipeline(transformer=transformer, vae=vae, scheduler=scheduler,
                       text_encoder=text, tokenizer=tokenizer)  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt="a cat walks on the grass", negative_prompt="", height=32, width=48,
               num_frames=9, num_inference_steps=2, guidance_scale=4.0, max_sequence_length=16,
               generator=torch.Generator().manual_seed(0), output_type="np")  # fmt: skip
    return out.frames[0]


def load_overlay(name: str, path: Path) -> Any:
    """Module ``name`` executed from ``path`` in place of the one imported."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    use_sites()
    out, names = Path(sys.argv[1]), sys.argv[2:]
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    import diffusers.utils.export_utils as export_utils

    overlay = os.environ.get(OVERLAY_ENV)
    if overlay:  # export_utils as the overlay has it (diffusers' package is imported whole)
        export_utils = load_overlay(EXPORT, Path(overlay) / "diffusers/utils/export_utils.py")

    inject_failure(os.environ.get("FRAMEWIRE_TEST_INJECT"))
    import framewire.integrations as integrations
    from framewire.integrations import diffusers as fw_diffusers

    own_export = export_utils.export_to_video
    report: dict[str, Any] = {"own": {}, "on": {}, "seconds": {}}
    every = cases()
    for name in names:
        if name == "pipeline":
            frames, kw = pipeline_frames(), {"fps": 16}
            report["frames"] = list(frames.shape)
        else:
            frames, kw = every[name]
        own_export(frames, str(out / f"{name}-own.mp4"), **kw)
        report["own"][name] = sha(out / f"{name}-own.mp4")
        started = time.monotonic()
        try:
            path = fw_diffusers.export_to_video(frames, str(out / f"{name}.mp4"), **kw)
            report["on"][name] = sha(Path(path))
        except Exception as exc:
            report["on"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        report["seconds"][name] = time.monotonic() - started
        if name == "pipeline":  # the usual call site, after install()
            fw_diffusers.install()
            from diffusers.utils import export_to_video

            export_to_video(frames, str(out / "installed.mp4"), **kw)
            report["installed"] = sha(out / "installed.mp4")
            report["rebound"] = export_to_video is fw_diffusers.export_to_video
    report["version"] = __import__("diffusers").__version__
    report["counts"] = integrations.counts()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
