"""An encoder binary as the worker holds it: refused when another user could change it,
run from the descriptor it was hashed from, its identity never stale, its colours checked."""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path

import numpy as np
import pytest
from framewire.core.errors import Forbidden
from framewire.core.media import colours
from framewire.core.media.binary import Binary
from framewire.core.media.identity import ffmpeg_identity
from framewire.core.media.process import FfmpegProcess

from tests.support.media import FFMPEG

OTHER_UID = 4242  # a user that is neither root nor the worker's


def script(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def runs(binary: Binary) -> str:
    """What ``binary`` prints, run as the worker runs it (from its descriptor)."""
    with FfmpegProcess([binary.exe], stdin=False, stdout=True, stall_s=10) as child:
        child.wait()
        return child.stdout_text().strip()


@pytest.mark.parametrize(
    "setup",
    ["directory_of_another_user", "file_of_another_user", "directory_writable_by_all",
     "directory_writable_by_group", "parent_of_another_user"],
)  # fmt: skip
def test_a_binary_another_user_could_change_is_refused(tmp_path, setup):
    env = tmp_path / "env" / "bin"
    env.mkdir(parents=True)
    exe = script(env / "ffmpeg", "echo hi")
    blamed = env
    if setup == "directory_of_another_user":
        os.chown(env, OTHER_UID, OTHER_UID)
    elif setup == "file_of_another_user":
        os.chown(exe, OTHER_UID, OTHER_UID)
        blamed = exe
    elif setup == "directory_writable_by_all":
        env.chmod(0o777)
    elif setup == "directory_writable_by_group":
        env.chmod(0o775)
    else:
        os.chown(env.parent, OTHER_UID, OTHER_UID)
        blamed = env.parent
    with pytest.raises(Forbidden) as refused:
        Binary(str(exe))
    assert refused.value.code == "binary_not_trusted"
    mode = stat.S_IMODE(os.lstat(blamed).st_mode)
    st_uid = os.lstat(blamed).st_uid
    assert f"{blamed} (owner uid {st_uid}, mode {mode:o})" in refused.value.message


def test_a_link_is_judged_where_it_leads_and_a_sticky_directory_is_trusted(tmp_path):
    shared = tmp_path / "shared"  # like /tmp: anyone may add names, none rename another's
    shared.mkdir()
    shared.chmod(0o1777)
    exe = script(shared / "ffmpeg", "echo sticky")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER_UID, OTHER_UID)
    binary = Binary(str(exe))
    assert runs(binary) == "sticky"
    binary.close()
    link = tmp_path / "link"
    link.symlink_to(script(theirs / "ffmpeg", "echo theirs"))
    with pytest.raises(Forbidden, match=f"{theirs} .owner uid {OTHER_UID}"):
        Binary(str(link))


def test_what_runs_is_what_was_hashed_whatever_the_path_names_later(tmp_path):
    exe = script(tmp_path / "ffmpeg", "echo first")
    binary = Binary(str(exe))
    first = binary.identity()
    # Another file renamed over it, of the same size and mtime: the path names it now,
    # but the worker still holds, runs and names the file it hashed.
    other = script(tmp_path / "other", "echo other")
    st = os.stat(exe)
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.rename(other, exe)
    assert binary.identity() == first and runs(binary) == "first"
    exe.unlink()  # gone, or a dangling link: still the same bytes
    assert binary.identity() == first and runs(binary) == "first"
    binary.close()


def test_an_identity_is_never_stale(tmp_path):
    exe = script(tmp_path / "ffmpeg", "echo 1")
    binary = Binary(str(exe))
    before, path_before = binary.identity(), ffmpeg_identity(exe)
    st = os.stat(exe)
    # Written in place, same size, mtime set back: only the ctime tells, and it is enough.
    time.sleep(0.01)
    with open(exe, "r+b") as f:
        f.seek(-2, os.SEEK_END)
        f.write(b"2\n")
    os.utime(exe, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(exe).st_size == st.st_size and os.stat(exe).st_mtime_ns == st.st_mtime_ns
    assert binary.identity() != before and runs(binary) == "2"
    assert ffmpeg_identity(exe) != path_before == before  # the caller's hash too
    binary.close()


def test_a_dropped_binary_lets_go_of_its_descriptor(tmp_path):
    exe = script(tmp_path / "ffmpeg", "echo 1")
    fds = set(os.listdir("/proc/self/fd"))
    Binary(str(exe))  # never closed: its finalizer closes it
    assert set(os.listdir("/proc/self/fd")) <= fds


def swapping(tmp_path: Path) -> Path:
    """An ffmpeg that reads RGB as BGR: red and blue swapped, as a broken build would."""
    body = 'for a in "$@"; do [ "$a" = rgb24 ] && a=bgr24; set -- "$@" "$a"; shift; done\n'
    return script(tmp_path / "ffmpeg-swapped", f'{body}exec {FFMPEG} "$@"')


def test_the_colour_check_passes_good_builds_and_fails_a_swapped_one(tmp_path):
    assert colours.check_ffmpeg(FFMPEG).ok
    debian = shutil.which("ffmpeg")
    if debian is not None:  # a second build (Debian's), another swscale
        assert colours.check_ffmpeg(debian).ok
    import av

    assert colours.check_pyav(av).ok
    swapped = colours.check_ffmpeg(str(swapping(tmp_path)))
    assert swapped.ran and not swapped.ok
    assert "red came out" in swapped.problem and "blue came out" in swapped.problem
    broken = colours.check_ffmpeg(str(script(tmp_path / "broken", "exit 3")))
    assert not broken.ran and "exited 3" in broken.problem


def test_the_judge_reads_each_bar(tmp_path):
    # The expected planes themselves pass; one bar moved by more than the tolerance fails
    # and is named.
    want = colours.expected()
    y = np.repeat(want[:, 0], colours.BAR_W)[None].repeat(colours.HEIGHT, 0)
    cb = np.repeat(want[:, 1], colours.BAR_W // 2)[None].repeat(colours.HEIGHT // 2, 0)
    cr = np.repeat(want[:, 2], colours.BAR_W // 2)[None].repeat(colours.HEIGHT // 2, 0)

    def planes(y: np.ndarray) -> bytes:
        return b"".join(np.round(p).astype(np.uint8).tobytes() for p in (y, cb, cr))

    assert colours.judge(planes(y), b"").ok
    y[:, 5 * colours.BAR_W : 6 * colours.BAR_W] += colours.TOLERANCE + 1
    wrong = colours.judge(planes(y), b"")
    assert not wrong.ok and wrong.problem.startswith("red came out")


def test_a_pyav_writer_that_imports_another_pyav_writes_nothing(tmp_path, monkeypatch):
    # The worker imported one PyAV and names it; the environment then upgraded under it.
    # The writer it starts imports the new one: its bytes would be another build's.
    from framewire.core.errors import Conflict
    from framewire.service._encode import encoders
    from framewire.service._encode.encoder import Encoder
    from framewire.service._encode.params import EncodeParams
    from framewire.service._sources.frames import TensorSource

    from tests.support.media import make_clip

    monkeypatch.setattr(encoders, "pyav_build", lambda: {"version": "0.0.1", "libavcodec": "0"})
    encoder = Encoder()
    out = tmp_path / "a.mp4"
    with pytest.raises(Conflict) as refused:
        encoder.encode(TensorSource(make_clip()), out, EncodeParams(fps=24, profile="vllm-omni"))
    assert refused.value.code == "encoder_unavailable"
    assert "not 0.0.1" in refused.value.message
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []
    encoder.close()
