"""The live view's tee keeps the file's bytes, for every ffmpeg profile, audio included.

Each case runs the plain encode command and the teed one (``live_fd``) on the same
frames and compares the files' sha256; the second slave's fragmented MP4 must
decode to the same frames. (Matroska outputs are left out: they carry random UIDs,
so two plain runs differ as well.)
"""

from __future__ import annotations

import os
import subprocess
import threading

import numpy as np
import pytest
from framewire.core.media.argv import encode_argv
from framewire.service._stream.fmp4 import boxes, starts_with_keyframe, video_samples

from tests.support.media import FFMPEG, decoded_frames, sha256

FRAMES = 40


def _frames(width: int, height: int) -> bytes:
    rng = np.random.default_rng(7)
    t = np.arange(FRAMES).reshape(-1, 1, 1, 1)
    x = np.arange(width).reshape(1, 1, -1, 1)
    y = np.arange(height).reshape(1, -1, 1, 1)
    base = (x * 3 + y * 2 + t * 5 + np.array([0, 60, 120])) % 256
    noise = rng.integers(0, 24, size=(FRAMES, height, width, 3))
    return ((base + noise) % 256).astype(np.uint8).tobytes()


def _run(argv: list[str], frames: bytes, live: int | None = None, slow: bool = False) -> bytes:
    """Run ``argv`` on ``frames``; what it wrote into the live pipe (read end ``live``)."""
    got = bytearray()
    reader = None
    if live is not None:

        def drain() -> None:
            while block := os.read(live, 1 << 16):
                got.extend(block)
                if slow:
                    threading.Event().wait(0.002)

        reader = threading.Thread(target=drain)
        reader.start()
    fds = () if live is None else (int(argv[-1].rsplit(":", 1)[1]),)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, pass_fds=fds)
    for fd in fds:
        os.close(fd)  # the child holds the write end now
    proc.communicate(frames, timeout=120)
    assert proc.returncode == 0
    if reader is not None:
        reader.join(30)
        os.close(live)  # type: ignore[arg-type]
    return bytes(got)


@pytest.mark.parametrize(
    ("profile", "size", "name", "audio", "slow"),
    [
        ("imageio", (96, 64), "plain.mp4", False, False),
        ("imageio", (100, 60), "with audio.mp4", True, True),
        ("sglang", (96, 64), "s|g'[1].mp4", False, False),
        ("sglang", (100, 60), "sglang-audio.mov", True, False),
        ("diffusers", (96, 64), "diffusers.mp4", False, False),
    ],
)
def test_tee_keeps_the_file_bytes(tmp_path, wav, profile, size, name, audio, slow):
    width, height = size
    frames = _frames(width, height)
    kw = {
        "width": width, "height": height, "fps": 24, "profile": profile,
        "quality": None if profile == "diffusers" else 5,
        "preset": None if profile == "diffusers" else "fast",
        "threads": 2, "audio": wav if audio else None,
    }  # fmt: skip
    plain = tmp_path / "plain" / name
    plain.parent.mkdir()
    _run(encode_argv(FFMPEG, output=plain, **kw), frames)
    teed = tmp_path / "teed" / name
    teed.parent.mkdir()
    read, write = os.pipe()
    live = _run(encode_argv(FFMPEG, output=teed, live_fd=write, **kw), frames, read, slow)
    assert sha256(teed) == sha256(plain)
    assert live[4:8] == b"ftyp" and b"moof" in live and b"mdat" in live
    # Cut by time: many fragments, only the first begins with a keyframe (GOP 250).
    moofs = [live[a:b] for kind, a, b in boxes(live) if kind == b"moof"]
    assert len(moofs) > 4 and sum(video_samples(m) for m in moofs) == FRAMES
    assert [starts_with_keyframe(m) for m in moofs] == [True] + [False] * (len(moofs) - 1)
    fragmented = tmp_path / "live.mp4"
    fragmented.write_bytes(live)
    # The viewer's copy holds the same pictures (the pixels, not only the packets).
    assert decoded_frames(fragmented) == decoded_frames(plain)


def test_a_closed_viewer_pipe_leaves_the_file_alone(tmp_path):
    """``onfail=ignore``: the live slave failing (nobody reads) never fails the file."""
    width, height = 96, 64
    frames = _frames(width, height)
    kw = {"width": width, "height": height, "fps": 24, "threads": 2}
    plain, teed = tmp_path / "a.mp4", tmp_path / "b.mp4"
    _run(encode_argv(FFMPEG, output=plain, **kw), frames)
    read, write = os.pipe()
    os.close(read)
    argv = encode_argv(FFMPEG, output=teed, live_fd=write, **kw)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, pass_fds=(write,))
    os.close(write)
    proc.communicate(frames, timeout=120)
    assert proc.returncode == 0
    assert sha256(teed) == sha256(plain)
