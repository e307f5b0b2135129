"""Faults: missing ffmpeg, ffmpeg dying mid-stream, bad paths, shrinking segments."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from framewire.client.wire import DType, Layout
from framewire.core.errors import BadRequest, MediaError, NotFound, Unavailable
from framewire.core.media.process import FfmpegProcess
from framewire.service._encode.encoder import EncodeParams, Encoder
from framewire.service._sources.frames import FileSource, Geometry, TensorSource, open_npy
from framewire.service._sources.shm import open_shm

from tests.support.media import FFMPEG, make_clip, reference_mp4, sha256
from tests.support.processes import child_pids, wait_gone


class KillFfmpegAt(TensorSource):
    """A source that kills this process's ffmpeg children when chunk ``at`` is read."""

    def __init__(self, clip: torch.Tensor, at: int):
        super().__init__(clip)
        self.at = at
        self.kills = 0

    def read(self, t0: int, t1: int, r0: int = 0, r1: int | None = None):
        if t0 == self.at and self.kills == 0:
            killed = child_pids()
            for pid in killed:
                os.kill(pid, signal.SIGKILL)
                self.kills += 1
            # Dead, its pipe closed, before any more frames are sent: else the rest of a
            # small clip may fit into the pipe before the kernel closes its read end.
            wait_gone(killed)
        return super().read(t0, t1, r0, r1)


def assert_nothing_at(path: Path) -> None:
    assert not path.exists()
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".framewire-tmp-")] == []


def test_ffmpeg_executable_missing(tmp_path):
    with pytest.raises(Unavailable) as err:
        Encoder(ffmpeg=str(tmp_path / "no-such-ffmpeg"))
    assert err.value.code == "ffmpeg_missing"


def test_ffmpeg_removed_after_the_start_still_runs_the_bytes_it_was_hashed_from(tmp_path):
    # The worker runs the descriptor it hashed, not the path: an environment removed or
    # upgraded under it changes nothing an encode writes.
    exe = tmp_path / "ffmpeg"
    shutil.copy(FFMPEG, exe)
    encoder = Encoder(ffmpeg=str(exe))
    exe.unlink()
    clip = make_clip()
    got = encoder.encode(TensorSource(clip), tmp_path / "a.mp4", EncodeParams(fps=24))
    want = Encoder().encode(TensorSource(clip), tmp_path / "b.mp4", EncodeParams(fps=24))
    assert got.sha256 == want.sha256
    encoder.close()


def test_ffmpeg_killed_mid_stream_falls_back_to_same_bytes(tmp_path):
    clip = make_clip(frames=30, height=75, width=100)
    source = KillFfmpegAt(clip, at=10)
    out = tmp_path / "a.mp4"
    fed: list[int] = []
    result = Encoder(chunk_bytes=1).encode(source, out, EncodeParams(fps=24), progress=fed.append)
    assert source.kills == 1
    assert result.route == "fallback"
    assert result.fast_path_error
    assert sha256(out) == reference_mp4(clip, tmp_path / "ref.mp4")
    # The progress heard the stream route's pieces, then the redone output's from 1 again.
    restart = fed.index(1, 1)
    assert fed[:restart] == list(range(1, restart + 1)) and restart < 30
    assert fed[restart:] == list(range(1, 31))


def test_ffmpeg_killed_mid_stream_without_fallback(tmp_path):
    source = KillFfmpegAt(make_clip(frames=30, height=75, width=100), at=10)
    out = tmp_path / "a.mp4"
    with pytest.raises(MediaError) as err:
        Encoder(chunk_bytes=1, fallback=False).encode(source, out, EncodeParams(fps=24))
    assert err.value.code == "ffmpeg_killed"
    assert "before it had every frame" in err.value.message
    assert_nothing_at(out)


def test_output_directory_missing(tmp_path):
    out = tmp_path / "nope" / "a.mp4"
    with pytest.raises(NotFound) as err:
        Encoder().encode(TensorSource(make_clip()), out, EncodeParams(fps=24))
    assert err.value.code == "output_dir_missing"
    assert not out.parent.exists()


def test_output_path_is_a_directory(tmp_path):
    (tmp_path / "d.mp4").mkdir()
    with pytest.raises(BadRequest) as err:
        Encoder().encode(TensorSource(make_clip()), tmp_path / "d.mp4", EncodeParams(fps=24))
    assert err.value.code == "output_is_directory"


def test_ffmpeg_refusing_is_not_retried_on_the_reference_route(tmp_path, monkeypatch):
    """An ffmpeg that exits with an error would fail the same way again: no fallback."""
    runs: list[list[str]] = []
    real = FfmpegProcess.__init__

    def spy(self, argv, **kw):
        runs.append(argv)
        real(self, argv, **kw)

    encoder = Encoder()  # its colour check's runs before the spy
    monkeypatch.setattr(FfmpegProcess, "__init__", spy)
    out = tmp_path / "a.notacontainer"
    with pytest.raises(MediaError) as err:
        encoder.encode(TensorSource(make_clip()), out, EncodeParams(fps=24))
    assert err.value.code == "ffmpeg_failed"
    # One encode, and the one -version that tells a refusal from a binary that no longer
    # runs (it runs: the refusal stands).
    assert [run[1:] for run in runs if "-version" in run] == [["-hide_banner", "-version"]]
    assert len(runs) == 2
    assert_nothing_at(out)


def test_audio_that_is_not_audio_fails_with_stderr_tail(tmp_path):
    bogus = tmp_path / "a.wav"
    bogus.write_bytes(b"not a wav file at all" * 10)
    out = tmp_path / "a.mp4"
    with pytest.raises(MediaError) as err:
        Encoder().encode(TensorSource(make_clip()), out, EncodeParams(fps=24, audio=bogus))
    assert err.value.code == "ffmpeg_failed"
    assert err.value.detail  # ffmpeg said why
    assert_nothing_at(out)


@pytest.mark.parametrize(
    ("params", "code"),
    [
        (EncodeParams(fps=0), "bad_fps"),
        (EncodeParams(fps=-24), "bad_fps"),
        (EncodeParams(fps=float("nan")), "bad_fps"),
        (EncodeParams(fps=24, quality=11), "bad_quality"),
        (EncodeParams(fps=24, threads=-1), "bad_threads"),  # 0 is x264's own count
        (EncodeParams(fps=24, quality=float("nan")), "bad_quality"),
        (EncodeParams(fps=24, profile="ffmpeg"), "bad_profile"),
        (EncodeParams(fps=24, value_range=(0.0, 1.0)), "bad_value_range"),
        (EncodeParams(fps=24, profile="vllm-omni", value_range=(1.0, 1.0)), "bad_value_range"),
        (EncodeParams(fps=24, profile="diffusers", audio=Path("a.wav")), "audio_unsupported"),
        (EncodeParams(fps=24, profile="vllm-omni", audio=Path("a.wav")), "audio_unsupported"),
    ],
)
def test_bad_parameters(tmp_path, params, code):
    with pytest.raises(BadRequest) as err:
        Encoder().encode(TensorSource(make_clip()), tmp_path / "a.mp4", params)
    assert err.value.code == code
    assert_nothing_at(tmp_path / "a.mp4")


def test_a_clip_without_frames_is_refused(tmp_path):
    np.save(tmp_path / "empty.npy", make_clip()[:, :0].numpy())
    source = open_npy(tmp_path / "empty.npy")
    try:
        with pytest.raises(BadRequest) as err:
            Encoder().encode(source, tmp_path / "a.mp4", EncodeParams(fps=24))
    finally:
        source.close()
    assert err.value.code == "no_frames"
    assert_nothing_at(tmp_path / "a.mp4")


class TruncateAt(FileSource):
    """A shm source whose owner shrinks the segment after the first chunk."""

    def __init__(self, *args, key: str, **kw):
        super().__init__(*args, **kw)
        self.key = key

    def read(self, t0: int, t1: int, r0: int = 0, r1: int | None = None):
        if t0 > 0:
            os.truncate(f"/dev/shm{self.key}", 100)
        return super().read(t0, t1, r0, r1)


def test_segment_shrinking_mid_encode_is_a_clear_error(tmp_path):
    clip = make_clip(frames=6)
    key = f"/framewire-test-{secrets.token_hex(6)}"
    Path(f"/dev/shm{key}").write_bytes(clip.numpy().tobytes())
    out = tmp_path / "a.mp4"
    try:
        geometry = Geometry(DType.float32, Layout.CTHW, 6, 48, 64)
        source = TruncateAt(open_shm(key, ["/framewire-test-"]), 0, geometry, key=key)
        with pytest.raises(BadRequest) as err:
            Encoder(chunk_bytes=1).encode(source, out, EncodeParams(fps=24))
        source.close()
    finally:
        Path(f"/dev/shm{key}").unlink()
    assert err.value.code == "segment_truncated"
    assert_nothing_at(out)
