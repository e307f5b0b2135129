"""What an output's answer says: checked (validate), counted (metrics), and reported.

One-shot encodes and stream sessions end the same way, so they share this.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from framewire.core.errors import FramewireError
from framewire.core.wire import ErrorInfo, MediaInfo, OutputResult, Timings
from framewire.service._encode.encoder import Encoded
from framewire.service._encode.params import EncodeParams
from framewire.service._encode.validate import validate_output
from framewire.service._ops.metrics import Metrics
from framewire.service._probe import pyav
from framewire.service._sources.frames import Geometry

log = logging.getLogger("framewire.outputs")


@dataclass
class Check:
    """Validates the output in its private directory, before its rename (a file that
    fails never appears)."""

    frames: int
    width: int
    height: int
    fps: float
    audio: bool
    profile: str = "imageio"
    info: MediaInfo | None = field(default=None, init=False)
    ms: float = field(default=0.0, init=False)

    def __call__(self, temp: str) -> None:
        t0 = time.perf_counter()
        try:
            self.info = validate_output(
                Path(temp),
                frames=self.frames,
                width=self.width,
                height=self.height,
                fps=self.fps,
                audio=self.audio,
                profile=self.profile,
            )
        finally:
            self.ms = (time.perf_counter() - t0) * 1e3


def check_for(frames: int, g: Geometry, params: EncodeParams, validate: bool) -> Check | None:
    """The checks ``frames`` frames of ``g``'s size encoded with ``params`` must pass; None
    where none was asked for, or where PyAV is not installed (the worker says so when it
    starts)."""
    if not validate or pyav() is None:
        return None
    return Check(frames, g.width, g.height, params.fps, params.audio is not None, params.profile)


def written(
    encoded: Encoded, fps: float, check: Check | None, started: float, metrics: Metrics
) -> OutputResult:
    """The answer for a complete output (counted in the metrics)."""
    if encoded.fast_path_error is not None:
        log.warning(
            "output %s was redone on the fallback route",
            encoded.path,
            extra={"fast_path_error": encoded.fast_path_error},
        )
    metrics.encode_seconds.labels(encoded.route).observe(encoded.encode_ms / 1e3)
    metrics.bytes_written.inc(encoded.bytes)
    if encoded.route == "fallback":
        metrics.fallbacks.inc()
    return output_result(encoded, fps, check, started)


def output_result(
    encoded: Encoded, fps: float, check: Check | None, started: float
) -> OutputResult:
    """The answer for a complete output, as its encode and its check found it."""
    info = check.info if check is not None else None
    return OutputResult(
        path=str(encoded.path),
        ok=True,
        bytes=encoded.bytes,
        sha256=encoded.sha256,
        frames=encoded.frames,
        width=info.width if info else None,
        height=info.height if info else None,
        fps=fps,
        duration=info.duration if info else None,
        audio=info.audio if info else None,
        route=encoded.route,
        timings=Timings(
            encode_ms=encoded.encode_ms,
            validate_ms=check.ms if check is not None else 0.0,
            started_at=started,
            finished_at=time.time(),
        ),
    )


def failed(path: Path | str, exc: FramewireError, queue_ms: float = 0.0) -> OutputResult:
    """The answer for an output that failed; logged with its code and ffmpeg's tail."""
    fields = {"code": exc.code} | ({"detail": exc.detail} if exc.detail else {})
    log.warning("output %s failed: %s", path, exc.message, extra=fields)
    return OutputResult(
        path=str(path),
        ok=False,
        error=ErrorInfo(code=exc.code, message=exc.message, detail=exc.detail),
        timings=Timings(queue_ms=queue_ms),
    )
