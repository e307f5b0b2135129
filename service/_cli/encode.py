"""``framewire encode``: an .npy clip to MP4, through the worker or in this process.

Through the worker the clip goes as a stream session (``open_video``), chunk by
chunk: the file is byte-identical to a whole-clip ``save_video`` (DESIGN 5.3),
this process holds two chunks rather than a copy of the clip, and the progress
shown is the worker's own count, carried by each chunk's answer (sent once the
worker has read the chunk into ffmpeg). ``--local`` encodes here; its progress
is the frames the encoder has fed to ffmpeg.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from framewire.core.errors import BadRequest
from framewire.service._access.urls import is_url
from framewire.service._cli.progress import Count, Meter, Output, rate

CHUNK_BYTES = 64 << 20  # a chunk's host frames at most (the client stages two chunks)
MIN_CHUNKS = 100  # a long clip goes in at least this many chunks: progress steps of 1 %


def chunk_frames(frames: int, frame_bytes: int) -> int:
    """Frames per stream chunk: within CHUNK_BYTES, and small enough for MIN_CHUNKS steps."""
    return max(1, min(CHUNK_BYTES // frame_bytes, -(-frames // MIN_CHUNKS)))


def refuse_empty(path: Path, frames: int) -> None:
    if frames == 0:
        raise BadRequest(f"{path} holds no frames", code="bad_shape")


def summary(fields: dict[str, Any], elapsed_s: float) -> str:
    line = (
        f"{fields['path']}: {fields['frames']} frames, {fields['bytes']} bytes, "
        f"sha256 {fields['sha256']}, route {fields['route']}, "
        f"{elapsed_s:.2f} s ({rate(fields['frames'], elapsed_s)})"
    )
    if fields.get("presigned_url"):
        line += f"\npresigned URL: {fields['presigned_url']}"
    return line


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """How the output is encoded, as both routes take it (the profile: docs/engines.md)."""
    value_range = None if args.value_range is None else tuple(args.value_range)
    return {
        "fps": args.fps,
        "quality": args.quality,
        "preset": args.preset,
        "threads": args.threads,
        "profile": args.profile,
        "value_range": value_range,
    }


def cmd_encode(args: argparse.Namespace) -> int:
    out = Output.of(args)
    encode = _local if args.local else _through_worker
    fields, elapsed_s = encode(args, out.live)
    out.result(summary(fields, elapsed_s), fields | {"elapsed_s": round(elapsed_s, 3)})
    return 0


def _through_worker(args: argparse.Namespace, live: bool) -> tuple[dict[str, Any], float]:
    import numpy as np
    from framewire.client import Client
    from framewire.core.frames import describe
    from framewire.core.wire import Layout

    clip = describe(np.load(args.input, mmap_mode="r"), args.layout)
    _, total, _, _ = clip.dims
    refuse_empty(args.input, total)
    step = chunk_frames(total, clip.nbytes // total)
    time_axis = 1 if clip.layout is Layout.CTHW else 0
    audio = None if args.audio is None else str(args.audio.absolute())
    # An object URL goes to the worker as it is; a file path as this process sees it.
    output = args.output if is_url(args.output) else str(Path(args.output).absolute())
    with Client(args.url, token=args.token, local_fallback=not args.worker_only) as client:
        writer = client.open_video(
            output, audio=audio, layout=clip.layout, presign_s=args.presign_s, **_options(args)
        )
        # The writer closes (the worker finishes the file) inside the meter's block.
        meter = Meter("encoding", total, lambda: writer.frames_received, live=live)
        with meter, writer:
            for t0 in range(0, total, step):
                span = (slice(None),) * time_axis + (slice(t0, t0 + step),)
                writer.write(clip.video[span])
    assert writer.result is not None
    return writer.result.model_dump(mode="json"), meter.elapsed_s


def _local(args: argparse.Namespace, live: bool) -> tuple[dict[str, Any], float]:
    from framewire.service._cli.settings import settings_from
    from framewire.service._convert import kernels
    from framewire.service._convert.convert import single_threaded_conversion
    from framewire.service._encode.encoder import EncodeParams, Encoder
    from framewire.service._sources.frames import open_npy

    if is_url(args.output) or args.presign_s is not None:
        raise BadRequest("--local writes files: object URLs go through a worker", code="bad_url")
    single_threaded_conversion()
    settings = settings_from(args)
    kernels.use(settings.kernel)
    encoder = Encoder.from_settings(settings)
    params = EncodeParams(audio=args.audio, **_options(args))
    source = open_npy(args.input, args.layout)
    fed = Count()
    try:
        refuse_empty(args.input, source.geometry.frames)
        with Meter("encoding", source.geometry.frames, fed.get, live=live) as meter:
            encoded = encoder.encode(source, Path(args.output), params, progress=fed.set)
    finally:
        source.close()
        encoder.close()
    return dataclasses.asdict(encoded), meter.elapsed_s
