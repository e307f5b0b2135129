"""Run in SGLang's own environment (tests/support/engine_site.py): SGLang's own plugin
loader and save functions (0.5.21 to 0.5.23), on cases named here; prints what came of
each.

``python -m tests.support.engine_sglang OUT_DIR CASE...``. SGLang's packages are
entered as path-only shells (their ``__init__`` would import the whole runtime)
and the few modules ``runtime/entrypoints/utils.py`` imports for types it does
not use on these paths are stubs; the loader (``platforms/plugins.py``), the
hook registry and every save function are SGLang's own files.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

from tests.support.engine_faults import inject_failure
from tests.support.engine_site import enter_shells, use_sites

UTILS = "sglang.multimodal_gen.runtime.entrypoints.utils"
PLUGINS = "sglang.multimodal_gen.runtime.platforms.plugins"
TASK_TYPE = "sglang.multimodal_gen.configs.task_type"
H3_REFERENCE = ("sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages"
                ".minimax_h3.reference_encoding")  # fmt: skip
# The functions of SGLang's utils framewire may hook (0.5.21 has the first two only).
HOOKED = ("_try_save_cuda_video_direct", "_try_save_cuda_videos_direct", "_save_video_ffmpeg",
          "CudaVideoEncoder.open")  # fmt: skip


def _bound(utils: Any, name: str) -> Any:
    """The object bound at ``name`` in SGLang's utils (a class's own attribute, as stored);
    None where this version has no such name."""
    owner, _, attr = name.rpartition(".")
    if owner:
        return vars(getattr(utils, owner, object)).get(attr)
    return getattr(utils, attr, None)


SHELLS = (
    "sglang", "sglang.multimodal_gen", "sglang.multimodal_gen.runtime", "sglang.srt",
    "sglang.multimodal_gen.configs", "sglang.multimodal_gen.configs.sample",
    "sglang.multimodal_gen.runtime.pipelines_core", "sglang.multimodal_gen.runtime.utils",
    "sglang.srt.observability", "sglang.multimodal_gen.runtime.entrypoints",
    "sglang.multimodal_gen.runtime.pipelines_core.stages",
    "sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages",
    "sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.minimax_h3",
    "sglang.multimodal_gen.runtime.distributed", "sglang.multimodal_gen.runtime.managers",
    "sglang.multimodal_gen.configs.models", "sglang.multimodal_gen.configs.models.vaes",
)  # fmt: skip


class ReplicaGroup:
    """What MiniMax-H3's decode reads of SGLang's replica group (a GroupCoordinator):
    the torch.distributed world of the test's ranks, its gloo group as ``cpu_group``."""

    @property
    def world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def rank_in_group(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def cpu_group(self) -> Any:
        import torch.distributed as dist

        return dist.group.WORLD


def enter_sglang() -> None:
    enter_shells("sglang", SHELLS)

    def stub(name: str, **attrs: Any) -> None:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod

    # sampling_params' DataType is configs/task_type.py's, SGLang's own (it imports enum only).
    data_type = importlib.import_module(TASK_TYPE).DataType
    stub("sglang.multimodal_gen.configs.sample.sampling_params", DataType=data_type,
         SamplingParams=object)  # fmt: skip
    stub("sglang.multimodal_gen.runtime.pipelines_core.request_utils",
         expand_request_outputs=None, normalize_output_seeds=None)  # fmt: skip
    stub("sglang.multimodal_gen.runtime.pipelines_core.schedule_batch", Req=object)
    stub("sglang.multimodal_gen.runtime.server_args", ServerArgs=object)
    stub("sglang.multimodal_gen.runtime.utils.profiler",
         maybe_record_function=lambda name: contextlib.nullcontext())  # fmt: skip
    stub("sglang.srt.observability.trace", TraceReqContext=object)
    stub("sglang.multimodal_gen.runtime.distributed.parallel_state",
         get_replica_group=ReplicaGroup)  # fmt: skip
    stub("sglang.multimodal_gen.runtime.managers.forward_context",
         set_forward_context=lambda **kw: contextlib.nullcontext())  # fmt: skip
    # envs reads the platform override only here; the real one imports zmq and more.
    override = os.environ.get("SGLANG_DIFFUSION_PLATFORM_OVERRIDE", "cpu")
    stub(
        "sglang.multimodal_gen.envs",
        SGLANG_DIFFUSION_PLATFORM_OVERRIDE=override,
        SGLANG_DIFFUSION_LOGGING_LEVEL="INFO",
        SGLANG_DIFFUSION_LOGGING_PREFIX="",
    )


def _clip(seed: int, t: int, h: int, w: int, dtype: str, spread: float = 1.0) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.rand(3, t, h, w, generator=g) * spread - (spread - 1) / 2  # past [0, 1] too
    return x.to(getattr(torch, dtype))


def _tone(seed: int, samples: int, channels: int) -> Any:
    """One output's waveform as save_outputs takes a request's: batched, (1, samples,
    channels) (SGLang gives output i ``audio[i]``)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, samples, channels, generator=g) * 0.6  # some past [-1, 1]


# name: (outputs, save_outputs keywords). Sizes are small: the suite runs them twice.
def cases() -> dict[str, tuple[list[Any], dict[str, Any]]]:
    return {
        "float32": ([_clip(1, 12, 64, 96, "float32", 1.4)], {"fps": 24}),
        "odd-size-23.976": ([_clip(2, 10, 35, 51, "float16")],
                            {"fps": 23.976, "output_compression": 70, "x264_preset": "ultrafast"}),
        "bf16-audio": ([_clip(3, 8, 48, 64, "bfloat16", 1.2)],
                       {"fps": 24, "audio": _tone(4, 16000 // 3, 1), "audio_sample_rate": 16000}),
        "stereo-inferred-rate": ([_clip(5, 12, 32, 48, "float32")],
                                 {"fps": 12, "audio": _tone(6, 24000, 2)}),
        "two-outputs": ([_clip(7, 8, 48, 64, "float32"), _clip(8, 8, 48, 64, "float32")],
                        {"fps": 16, "x264_preset": "veryfast"}),
        # Two outputs at SGLang's own preset (0.5.21 takes no x264_preset).
        "pair": ([_clip(14, 6, 32, 48, "float32"), _clip(15, 6, 32, 48, "float16")],
                 {"fps": 12, "output_compression": 60}),
        "materialized": ([_clip(9, 9, 40, 56, "float32")], {"fps": 8, "frames_out": []}),
        "uint8-tensor": ([(_clip(10, 6, 32, 32, "float32") * 255).to(__import__("torch").uint8)],
                         {"fps": 24}),
        "bad-quality": ([_clip(11, 6, 32, 32, "float32")], {"fps": 24, "output_compression": 5}),
        # The encode-while-decoding stage's clip, saved whole: what its stream must equal.
        "streamed-whole": ([_clip(12, 12, 40, 72, "float32", 1.2)],
                           {"fps": 24, "audio": _tone(13, 8000, 1), "audio_sample_rate": 16000,
                            "output_compression": 60, "x264_preset": "veryfast"}),
    }  # fmt: skip


def streamed(utils: Any, path: Path, device: Any) -> str | None:
    """``streamed-whole``'s clip through ``CudaVideoEncoder.open`` in 3 chunks, as the
    encode-while-decoding stage feeds it; the sha256, or None when ``open`` says no."""
    [clip], kw = cases()["streamed-whole"]
    encoder = utils.CudaVideoEncoder.open(
        str(path), device=device, height=40, width=72, fps=kw["fps"], num_frames=12,
        audio=kw["audio"][0], audio_sample_rate=kw["audio_sample_rate"],
        output_compression=kw["output_compression"], x264_preset=kw["x264_preset"],
    )  # fmt: skip
    if encoder is None:
        return None
    for t0 in range(0, 12, 5):
        encoder.write(clip[:, t0 : t0 + 5])
    encoder.close()
    return hashlib.sha256(path.read_bytes()).hexdigest()


def h3_rank(rank: int, world: int, port: int, video: str, report_path: str) -> None:
    """One rank of MiniMax-H3's shared reference decode (``share_across_replicas``)."""
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    enter_sglang()

    import torch.distributed as dist

    plugins = importlib.import_module(PLUGINS)
    plugins.load_plugins()
    plugins.apply_plugin_hooks()
    reference = importlib.import_module(H3_REFERENCE)
    import framewire.integrations as integrations

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        frames = reference.minimax_h3_decode_reference_video_frames(
            video, target_width=64, target_height=48, target_frame_count=10, fps=12,
            start_time_seconds=0.25, share_across_replicas=True,
        )  # fmt: skip
        frames[0, 0, 0] = 7  # SGLang's callers may write into it
        frames[0, 0, 0] = frames[1, 0, 0]
        digest = hashlib.sha256(frames[1:].tobytes()).hexdigest()
        result: dict[str, Any] = {"sha256": digest, "shape": list(frames.shape)}
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        dist.barrier()  # no rank leaves while another is still in a collective
        dist.destroy_process_group()
    result["counts"] = integrations.counts()
    Path(report_path).write_text(json.dumps(result))
    # Past the report, nothing of the rank's is left to check: leave without the
    # interpreter's teardown, where torch's gloo threads now and then abort the process
    # ("terminate called without an active exception") after the work is done.
    logging.shutdown()
    os._exit(0)


def main() -> None:
    use_sites()
    if sys.argv[1] == "h3":
        rank, world, port = (int(a) for a in sys.argv[2:5])
        h3_rank(rank, world, port, sys.argv[5], sys.argv[6])
        return
    out, names = Path(sys.argv[1]), sys.argv[2:]
    # A server's logging: SGLang's processes log at INFO.
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    enter_sglang()

    utils = importlib.import_module(UTILS)
    plugins = importlib.import_module(PLUGINS)
    originals = {name: _bound(utils, name) for name in HOOKED if _bound(utils, name)}
    inject_failure(os.environ.get("FRAMEWIRE_TEST_INJECT"), plugins)
    plugins.load_plugins()
    plugins.apply_plugin_hooks()
    for thread in threading.enumerate():  # framewire's check of the hooks, once they applied
        if thread.name == "framewire-sglang-check":
            thread.join(timeout=30)
    import framewire.integrations as integrations
    import framewire.integrations.sglang as fw_sglang

    report: dict[str, Any] = {
        "unchanged": {n: _bound(utils, n) is was for n, was in originals.items()},
        "hooked": fw_sglang.hooked(),
        "ffmpeg": utils._resolve_ffmpeg_exe(),
        "results": {},
        "seconds": {},
    }
    every = cases()
    if "streamed" in names:  # CPU frames: SGLang's own open says no (None) to them
        names.remove("streamed")
        import torch

        report["streamed-cpu"] = streamed(utils, out / "streamed-cpu.mp4", torch.device("cpu"))
        # Only the device check reads the device: a stand-in that says "cuda" lets the
        # rest of the route run on CPU frames (their transport is the host's, not IPC).
        if report["hooked"].get("CudaVideoEncoder.open"):
            cuda = types.SimpleNamespace(type="cuda")
            report["streamed"] = streamed(utils, out / "streamed.mp4", cuda)
    for name in names:
        outputs, kw = every[name]
        paths = [out / f"{name}-{i}.mp4" for i in range(len(outputs))]
        started = time.monotonic()
        try:
            video = importlib.import_module(TASK_TYPE).DataType.VIDEO
            utils.save_outputs(outputs, video, kw.pop("fps"), True,
                               lambda i, paths=paths: str(paths[i]), **kw)  # fmt: skip
            report["results"][name] = [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]
        except Exception as exc:
            report["results"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        report["seconds"][name] = time.monotonic() - started
    report["counts"] = integrations.counts()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
