"""Does a written file hold what was asked for? Facts from PyAV, compared with the request."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

from framewire.core.errors import MediaError
from framewire.core.media.argv import output_size, profile_rate
from framewire.core.wire import MediaInfo
from framewire.service._probe import probe

MAX_DURATION_DRIFT = 0.25  # seconds


def validate_output(
    path: Path,
    *,
    frames: int,
    width: int,
    height: int,
    fps: float,
    audio: bool,
    profile: str = "imageio",
) -> MediaInfo:
    """Probe ``path`` and raise MediaError(code="validation_failed") listing every mismatch."""
    # Nothing checked here needs decoding, nor more than an MP4's header and index.
    info = probe(path, pixel_format=False, header_only=True)
    problems: list[str] = []
    if info.frames != frames:
        problems.append(f"{info.frames} frames, expected {frames}")
    want_w, want_h = output_size(profile, width, height)
    if (info.width, info.height) != (want_w, want_h):
        problems.append(f"size {info.width}x{info.height}, expected {want_w}x{want_h}")
    want_fps = profile_rate(profile, fps)
    if abs(Fraction(info.fps_exact) - want_fps) > Fraction(1, 1000):
        problems.append(f"fps {info.fps_exact}, expected {want_fps}")
    if (info.audio is not None) != audio:
        problems.append("an audio stream" if info.audio else "no audio stream, expected one")
    expected = float(frames / want_fps)
    if info.duration is None or abs(info.duration - expected) > MAX_DURATION_DRIFT:
        problems.append(f"duration {info.duration}, expected {expected:.3f} ± {MAX_DURATION_DRIFT}")
    if problems:
        raise MediaError(f"{path.name}: " + "; ".join(problems), code="validation_failed")
    return info
