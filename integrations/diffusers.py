"""diffusers' ``export_to_video`` (0.38.0 to 0.42.1), saved through the worker with
diffusers' own bytes.

diffusers has no plugin system: import the drop-in instead of diffusers' name,

    from framewire.integrations.diffusers import export_to_video

or call :func:`install` once (``FRAMEWIRE_INTEGRATIONS=diffusers`` is not needed
then) to rebind ``diffusers.utils.export_to_video`` for code that looks it up
there. Same parameters, defaults and return as diffusers'. Routed: float32 numpy
frames or PIL images, to an ``.mp4`` under the worker's output roots, at diffusers'
defaults for ``bitrate`` and ``macro_block_size``, with the encoder diffusers'
imageio runs. Everything else (no path: a temporary file; a bitrate; another macro
block size; float64 or uint8 arrays, which diffusers scales by 255 with numpy's
wrap-around; a worker that does not answer; a diffusers version outside the range,
or whose ``export_to_video`` has other parameters) runs diffusers' own.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import numpy as np
from framewire.client import ffmpeg_identity
from framewire.integrations._probe import Engine, Probe, Target
from framewire.integrations._route import guarded, route
from framewire.integrations._switch import Declined
from framewire.integrations._worker import WORKER, Into, copied, write_frames

EXPORT = "diffusers.utils.export_utils"
DIFFUSERS = Engine(
    "diffusers", "diffusers", ("0.38.0", "0.39.0", "0.40.0", "0.41.0", "0.42.0", "0.42.1")
)
TARGET = Target(
    EXPORT,
    "export_to_video",
    dict.fromkeys(
        DIFFUSERS.versions,
        "(video_frames, output_video_path=None, fps=10, quality=5.0, bitrate=None, "
        "macro_block_size=16)",
    ),
)

_original: Any = None
_verified: bool | None = None  # whether the probe found diffusers' function as verified
_installed = False


def _diffusers_export() -> Any:
    global _original
    if _original is None:
        _original = importlib.import_module(EXPORT).export_to_video
    return _original


def _probed() -> bool:
    """Whether diffusers' function probes as verified (probed once, never raising)."""
    global _verified
    if _verified is None:
        _verified = False

        def probe() -> None:
            global _verified
            _verified = Probe(DIFFUSERS).allows((TARGET,))

        guarded("the probe of diffusers' export_to_video", probe)
    return _verified


def _identity() -> str:
    imageio_ffmpeg = importlib.import_module("imageio_ffmpeg")
    return ffmpeg_identity(imageio_ffmpeg.get_ffmpeg_exe())


def _rate_spelled_alike(fps: float) -> bool:
    """Whether diffusers' imageio-ffmpeg spells this rate as framewire's profile does:
    0.6 and older write ``{fps:.02f}``, newer ones the exact fraction."""
    if float(fps).is_integer():
        return True
    version = importlib.import_module("imageio_ffmpeg").__version__
    major, minor = (int(p) for p in version.split(".")[:2])
    return (major, minor) >= (0, 7)


def _scaler() -> Into:
    """diffusers' own conversion of float32 frames, here as there: ``(frame * 255)`` cast
    to uint8 without a clamp (out-of-range values wrap as numpy casts them), in place in
    one float frame kept for the whole clip."""
    scratch: np.ndarray | None = None

    def into(frame: np.ndarray, out: np.ndarray) -> None:
        nonlocal scratch
        if scratch is None:
            scratch = np.empty(frame.shape, np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            np.multiply(frame, 255, out=scratch)
            out[...] = scratch

    return into


def _converter(video_frames: Any) -> Into:
    """How each frame is handed over: float32 arrays scaled to 8 bits as diffusers scales
    them (a chunk at a time: a quarter of the bytes to hand over, and never more of the
    clip held here than diffusers holds), PIL images as their 8-bit arrays; Declined for
    anything else."""
    first = video_frames[0]
    if isinstance(first, np.ndarray):
        if any(not isinstance(f, np.ndarray) or f.dtype != np.float32 for f in video_frames):
            raise Declined("frames that are not float32 arrays")
        return _scaler()
    if type(first).__module__.startswith("PIL."):
        if np.array(first).dtype != np.uint8:
            raise Declined("images that are not 8-bit")
        return copied
    raise Declined("frames that are neither arrays nor PIL images")


def export_to_video(
    video_frames: list[np.ndarray] | list[Any],
    output_video_path: str | None = None,
    fps: int = 10,
    quality: float = 5.0,
    bitrate: int | None = None,
    macro_block_size: int | None = 16,
) -> str:
    """diffusers' ``export_to_video``: the frames to an MP4 at ``output_video_path``
    (a temporary file when None); returns the path. Routed through the worker when
    framewire gives diffusers' bytes, else diffusers' own function runs."""
    args = (video_frames, output_video_path, fps, quality, bitrate, macro_block_size)

    def routed() -> str:
        if not _probed():
            raise Declined("a diffusers version or export_to_video not verified")
        if output_video_path is None:
            raise Declined("no output path (a temporary file)")
        if bitrate is not None or macro_block_size != 16 or quality is None:
            raise Declined("a bitrate, a macro block size or no quality")
        if os.path.splitext(output_video_path)[1].lower() != ".mp4":
            raise Declined("not an .mp4 output")
        if not 0 <= quality <= 10 or not _rate_spelled_alike(fps):
            raise Declined("a quality or rate diffusers' imageio spells otherwise")
        if not len(video_frames):
            raise Declined("no frames")
        into = _converter(video_frames)
        write_frames(
            WORKER.target(output_video_path),
            video_frames,
            into,
            fps=fps,
            quality=quality,
            profile="diffusers",
            encoder=_identity(),
        )
        return output_video_path

    path: str = route("diffusers", routed, _diffusers_export(), args, {})
    return path


def install() -> None:
    """Rebind ``diffusers.utils.export_to_video`` (and ``export_utils``') to the drop-in,
    where diffusers' function probes as verified; never raises."""

    def rebind() -> None:
        global _installed
        _diffusers_export()
        if _probed():
            for name in ("diffusers.utils", EXPORT):
                setattr(importlib.import_module(name), "export_to_video", export_to_video)  # noqa: B010
            _installed = True

    guarded("the diffusers integration's install", rebind)


def uninstall() -> None:
    """Put diffusers' own function back."""
    global _installed
    if _installed:
        for name in ("diffusers.utils", EXPORT):
            setattr(importlib.import_module(name), "export_to_video", _original)  # noqa: B010
        _installed = False
