"""``framewire decode``: a reference decode, from the worker or (when none answers) here.

What the progress can honestly be differs by route:

- **here** (the local fallback): ffmpeg writes the rgb24 frames into a memfd of
  this process, so the frames done are that memfd's size; the total is the
  probed duration times the fps (capped by ``--max-frames``), an estimate
  until the decode ends.
- **the worker**: the fd socket answers once, with the finished frames; the
  worker reports nothing while it decodes, so only the elapsed time is shown.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from typing import TYPE_CHECKING, Any

from framewire.service._cli.progress import Meter, Output, rate

if TYPE_CHECKING:
    from framewire.client import ReferenceFrames
    from framewire.core.decode import DecodeRun
    from framewire.core.wire import DecodeRequest


class _Watched:
    """The local decode's run, once it has started: its frames written so far."""

    def __init__(self) -> None:
        self.run: DecodeRun | None = None

    def started(self, run: DecodeRun) -> None:
        self.run = run

    def frames(self) -> int:
        return 0 if self.run is None else self.run.frames_written()


def expected_frames(request: DecodeRequest) -> int | None:
    """About how many frames the decode gives: the probed duration after ``start`` at
    the request's fps, at most ``max_frames``; None when the file does not say."""
    from framewire.core.errors import FramewireError
    from framewire.service._probe import probe

    try:
        duration = probe(request.path, pixel_format=False).duration
    except (FramewireError, OSError):
        duration = None
    if duration is None:
        return request.max_frames
    frames = max(0, round((duration - request.start) * request.fps))
    return frames if request.max_frames is None else min(frames, request.max_frames)


def fetch(request: DecodeRequest, args: argparse.Namespace, live: bool) -> ReferenceFrames:
    """The worker's answer, else (if allowed) the same decode here; each with its meter."""
    from framewire.core.errors import Unavailable
    from framewire.core.reference import decode_from_worker, decode_locally

    try:
        with Meter("decoding in the worker", None, None, live=live):
            return decode_from_worker(request, args.fd_socket)
    except Unavailable:
        if not args.fallback:
            raise
    watched = _Watched()
    total = expected_frames(request) if live else None
    with Meter("decoding here", total, watched.frames, live=live):
        return decode_locally(request, started=watched.started)


def cmd_decode(args: argparse.Namespace) -> int:
    import numpy as np
    from framewire.core.reference import make_request

    out = Output.of(args)
    width, height = args.size
    request = make_request(
        args.input,
        fps=args.fps,
        width=width,
        height=height,
        start=args.start,
        max_frames=args.max_frames,
    )
    started = time.monotonic()
    ref = fetch(request, args, out.live)
    elapsed_s = time.monotonic() - started  # the decode as this command waited for it
    with ref:
        if args.output is not None:
            np.save(args.output, ref.frames)
        fields: dict[str, Any] = {
            "path": str(args.input),
            "frames": ref.shape[0],
            "width": width,
            "height": height,
            "bytes": ref.nbytes,
            "sha256": hashlib.sha256(ref.frames.data).hexdigest(),
            "source": ref.source,
            "cached": ref.cached,
            "decode_ms": round(ref.decode_ms, 3),
            "output": None if args.output is None else str(args.output),
        }
    done = "cached" if ref.cached else f"decoded in {ref.decode_ms:.0f} ms"
    line = (
        f"{args.input}: {fields['frames']} frames of {width}x{height}, {ref.nbytes} bytes, "
        f"sha256 {fields['sha256']}, from {ref.source}, {done}, "
        f"{elapsed_s:.2f} s ({rate(fields['frames'], elapsed_s)})"
    )
    out.result(line, fields | {"elapsed_s": round(elapsed_s, 3)})
    return 0
