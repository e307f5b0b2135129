"""The encoders a worker can run, each named by its identity; a request may ask for one.

The default ffmpeg (``FRAMEWIRE_FFMPEG``, else imageio-ffmpeg's) runs every
request that names none. ``FRAMEWIRE_ENCODERS`` adds binaries (the ones the
engines served here pin), and PyAV is the ``vllm-omni`` profile's encoder. A
request naming an identity the worker does not hold is refused (409
``encoder_unavailable``), never served by another build: its bytes would differ.
"""

from __future__ import annotations

import functools
import re
import subprocess
from collections.abc import Callable

from framewire.core.errors import Conflict
from framewire.core.media.identity import PYAV, ffmpeg_identity, pyav_identity
from framewire.core.media.process import resolve_ffmpeg
from framewire.service._ops.versions import ffmpeg_version
from framewire.service._probe import pyav, pyav_build

# x264 writes its build into the stream it makes (an SEI message), e.g.
# "x264 - core 164 r3095 baee400": the one place a binary says which libx264 it runs.
_X264 = re.compile(rb"x264 - core (\d+)(?: r(\d+))?(?: ([0-9a-f]+))? -")
PROBE_TIMEOUT_S = 20.0


def x264_build(stream: bytes) -> str | None:
    """``core N[ rNNNN hash]`` from an H.264 stream x264 wrote, or None."""
    found = _X264.search(stream)
    if found is None:
        return None
    core, rev, commit = found.groups()
    build = f"core {core.decode()}"  # some builds name no revision
    if rev:
        build += f" r{rev.decode()}"
    return f"{build} {commit.decode()}" if commit else build


@functools.cache
def ffmpeg_x264(exe: str) -> str | None:
    """The libx264 build of ``exe``: one 16x16 frame encoded (tens of milliseconds, once)."""
    argv = [exe, "-v", "error", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", "16x16"]
    argv += ["-i", "pipe:0", "-frames:v", "1", "-c:v", "libx264", "-f", "h264", "pipe:1"]
    try:
        done = subprocess.run(
            argv, input=bytes(16 * 16 * 3), capture_output=True, timeout=PROBE_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return x264_build(done.stdout) if done.returncode == 0 else None


@functools.cache
def pyav_x264() -> str | None:
    """The libx264 build PyAV's wheel bundles (one frame encoded in this process)."""
    av = pyav()
    if av is None:
        return None
    try:
        import numpy as np

        ctx = av.CodecContext.create("libx264", "w")
        ctx.width = ctx.height = 16
        ctx.pix_fmt = "yuv420p"
        frame = av.VideoFrame.from_ndarray(np.zeros((16, 16, 3), np.uint8), format="rgb24")
        packets = list(ctx.encode(frame.reformat(format="yuv420p"))) + list(ctx.encode(None))
    except Exception:
        return None
    return x264_build(b"".join(bytes(p) for p in packets))


def describe_ffmpeg(path: str) -> dict[str, object]:
    identity = ffmpeg_identity(path)
    return {
        "id": identity,
        "kind": "ffmpeg",
        "path": path,
        "sha256": identity.split(":", 1)[1],
        "version": ffmpeg_version(path),
        "libx264": ffmpeg_x264(path),
    }


class Encoders:
    """The ffmpeg binaries (the default first) and PyAV, by identity. Identities are
    worked out when first asked for (hashing a binary takes a tenth of a second)."""

    def __init__(self, default: str | None = None, extra: list[str] | None = None):
        paths = [resolve_ffmpeg(default)] + [resolve_ffmpeg(p) for p in extra or []]
        self.paths = list(dict.fromkeys(paths))  # the default first, each path once
        self.default = self.paths[0]
        self.on_refusal: Callable[[], None] = lambda: None  # the worker counts them

    def warm(self) -> None:
        """Ask each binary for its libx264 build now (about 20 ms each), at the worker's
        start: a later /v1/info then starts no x264 beside the encodes."""
        for path in self.paths:
            ffmpeg_x264(path)

    def by_identity(self) -> dict[str, str]:
        found: dict[str, str] = {}
        for path in self.paths:
            found.setdefault(ffmpeg_identity(path), path)  # one binary twice: its first path
        return found

    def pick(self, asked: str | None, profile: str) -> str | None:
        """The ffmpeg executable for a request that asks for ``asked`` (None: the default;
        the vllm-omni profile runs PyAV, so it has no executable); raises 409
        ``encoder_unavailable`` for an identity not held here."""
        if profile == "vllm-omni":
            held = self.pyav_id()
            if asked is not None and asked != held:
                self._refuse(asked, [held] if held else [])
            return None
        if asked is None:
            return self.default
        binaries = self.by_identity()
        if asked not in binaries:
            self._refuse(asked, list(binaries))
        return binaries[asked]

    @staticmethod
    def pyav_id() -> str | None:
        build = pyav_build()
        return None if build is None else pyav_identity(build["version"])

    def _refuse(self, asked: str, held: list[str]) -> None:
        self.on_refusal()
        kind = "PyAV" if asked.startswith(PYAV) else "ffmpeg"
        holds = ", ".join(held) or "none"
        raise Conflict(
            f"this worker holds no {kind} encoder {asked!r} (it holds: {holds})",
            code="encoder_unavailable",
        )

    def describe(self) -> list[dict[str, object]]:
        """Every encoder, as ``/v1/info`` reports it (the default first)."""
        out = [
            describe_ffmpeg(path) | {"default": path == self.default}
            for path in self.by_identity().values()
        ]
        build = pyav_build()
        if build is not None:
            pyav_id = pyav_identity(build["version"])
            out.append({"id": pyav_id, "kind": "pyav", **build, "libx264": pyav_x264()})
        return out
