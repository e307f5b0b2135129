"""What ``framewire encode`` and ``framewire decode`` print, run as real processes: progress
drawn in place on a pseudo-terminal, only the summary (or one JSON object) elsewhere."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import termios
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from framewire.client.wire import Layout

from tests.support.cli import run_cli, start_cli
from tests.support.media import make_clip, reference_mp4, sha256
from tests.support.refclips import make_video
from tests.support.worker import Worker

ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
NO_WORKER = ["--fd-socket", "/nonexistent/fd.sock"]  # decode: the local fallback
# Well past what ffmpeg and x264 read ahead of the encode (the pipe, x264's lookahead: ~40
# frames), at a size one x264 thread takes several redraws over: the counts climb.
FRAMES, HEIGHT, WIDTH = 240, 256, 448
SLOW = ["--layout", "THWC", "--threads", "1"]
# Where only what is printed at the end is checked (piped, --json, --quiet, no count): a
# clip of any size. A meter that draws at all draws as it starts and as it ends (rich
# hides the cursor, the last redraw shows the label), so a short run shows it too.
SMALL_FRAMES, SMALL_HEIGHT, SMALL_WIDTH = 12, 48, 64
DECODE, DECODED_FRAMES = ["--fps", "30", "--size", "320x180"], 90  # 3 s of the reference
SMALL_DECODED_FRAMES = 15  # half a second of the small reference, at 30 fps


def on_terminal(*args: str, timeout: float = 120) -> tuple[int, str]:
    """Run the command with a pseudo-terminal as stdin, stdout and stderr; all it wrote.
    The terminal is the command's by path (a fork of the zygote opens it itself), so
    this end stays open until the command has exited and its last words are read."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    env = os.environ | {"TERM": "xterm-256color"}
    terminal = os.ttyname(follower)
    proc = start_cli(*args, stdio=(terminal, terminal, terminal), env=env)
    output = bytearray()
    deadline = time.monotonic() + timeout
    try:
        exited = False
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.25 if exited else 0.05)
            if ready:
                output += os.read(leader, 65536)
            elif exited:
                break  # gone, and nothing more came
            else:
                exited = proc.poll() is not None
        return proc.wait(timeout=max(1.0, deadline - time.monotonic())), output.decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(follower)
        os.close(leader)


def piped(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args)


def screens(output: str) -> list[str]:
    """Each state the terminal showed: the text between carriage returns and newlines."""
    return [s.strip() for s in re.split(r"[\r\n]+", ESCAPE.sub("", output)) if s.strip()]


def summary_of(output: str) -> str:
    return screens(output)[-1]


def counts(output: str, total: int) -> list[int]:
    return [int(n) for n in re.findall(rf"(\d+)/{total} frames", ESCAPE.sub("", output))]


def assert_counted_up(output: str, total: int) -> None:
    seen = counts(output, total)
    assert len(set(seen)) >= 3, seen  # a start, at least one step, the end
    assert seen == sorted(seen) and seen[0] < total and seen[-1] == total, seen


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    frames = make_clip(FRAMES, HEIGHT, WIDTH, dtype=torch.uint8, layout=Layout.THWC)
    path = tmp_path_factory.mktemp("clip") / "clip.npy"
    np.save(path, frames.numpy())
    return path, frames


@pytest.fixture(scope="module")
def small_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    frames = make_clip(SMALL_FRAMES, SMALL_HEIGHT, SMALL_WIDTH, dtype=torch.uint8,
                       layout=Layout.THWC)  # fmt: skip
    path = tmp_path_factory.mktemp("small") / "clip.npy"
    np.save(path, frames.numpy())
    return path


@pytest.fixture(scope="module")
def reference(worker: Worker) -> Path:
    """A reference video under the worker's input roots, slow enough to decode (1080p
    noise) that a decode of it lasts several redraws, yet small once decoded."""
    noisy = "testsrc2=size=1920x1080:rate=30,noise=alls=30:allf=t"
    return make_video(worker.inputs / "ref.mp4", noisy, 3.0)


@pytest.fixture(scope="module")
def small_reference(worker: Worker) -> Path:
    """A reference video that decodes in a moment (the big one takes 2 s of CPU)."""
    return make_video(worker.inputs / "small.mp4", "testsrc2=size=320x180:rate=30", 0.5)


def test_local_encode_on_a_terminal_counts_up_then_summarizes(tmp_path, clip):
    npy, _ = clip
    out = tmp_path / "out.mp4"
    rc, output = on_terminal("encode", str(npy), str(out), "--fps", "24", "--local", *SLOW,
                             "--chunk-bytes", "1")  # fmt: skip
    assert rc == 0, output
    assert "\x1b[" in output  # drawn in place
    assert_counted_up(output, FRAMES)
    assert re.search(r"\d+\.\d fps", ESCAPE.sub("", output)) and "elapsed" in output
    last = summary_of(output)
    assert last.startswith(f"{out}: {FRAMES} frames") and sha256(out) in last, last
    assert re.search(r"route stream, \d+\.\d\d s \(\d+\.\d fps\)$", last), last


def test_worker_encode_on_a_terminal_counts_the_workers_answers(worker, clip):
    npy, frames = clip
    out = worker.outputs / "terminal.mp4"
    rc, output = on_terminal("encode", str(npy), str(out), "--fps", "24", *SLOW,
                             "--url", worker.uds_url)  # fmt: skip
    assert rc == 0, output
    assert_counted_up(output, FRAMES)  # 80 chunks of 3 frames, each answered by the worker
    last = summary_of(output)
    assert last.startswith(f"{out}: {FRAMES} frames") and "route stream" in last, last
    assert sha256(out) in last
    ref = worker.outputs / "terminal-ref.mp4"
    assert sha256(out) == reference_mp4(frames, ref, layout=Layout.THWC, threads=1)


def test_worker_encode_keeps_every_option_and_every_byte(worker, wav, tmp_path):
    clip = make_clip(frames=30, height=75, width=100, dtype=torch.uint8, layout=Layout.THWC)
    np.save(tmp_path / "clip.npy", clip.numpy())
    audio = worker.inputs / "tone.wav"
    shutil.copy(wav, audio)
    out = worker.outputs / "options.mp4"
    run = piped("encode", str(tmp_path / "clip.npy"), str(out), "--fps", "23.976",
                "--layout", "THWC", "--quality", "7", "--preset", "veryfast", "--threads", "2",
                "--audio", str(audio), "--url", worker.uds_url)  # fmt: skip
    assert run.returncode == 0, run.stderr
    expected = reference_mp4(clip, tmp_path / "ref.mp4", layout=Layout.THWC, fps=23.976,
                             quality=7, preset="veryfast", threads=2, audio=audio)  # fmt: skip
    assert sha256(out) == expected


@pytest.mark.parametrize("route", ["local", "worker", "decode"])
def test_piped_output_is_the_summary_alone(worker, small_clip, small_reference, tmp_path, route):
    npy = small_clip
    if route == "decode":
        run = piped("decode", str(small_reference), *DECODE, "--fd-socket", str(worker.fd_socket))
    else:
        out = worker.outputs / f"piped-{route}.mp4"
        where = ["--local"] if route == "local" else ["--url", worker.uds_url]
        run = piped("encode", str(npy), str(out), "--fps", "24", "--layout", "THWC", *where)
    assert run.returncode == 0, run.stderr
    assert "\x1b" not in run.stdout + run.stderr and "\r" not in run.stdout + run.stderr
    assert len(run.stdout.splitlines()) == 1 and run.stdout.endswith("\n"), run.stdout
    assert re.search(r"\d+\.\d\d s \(\d+\.\d fps\)$", run.stdout.strip()), run.stdout


def test_quiet_on_a_terminal_is_the_summary_alone(tmp_path, small_clip):
    out = tmp_path / "quiet.mp4"
    rc, output = on_terminal("encode", str(small_clip), str(out), "--fps", "24", "--local",
                             "--layout", "THWC", "--quiet")  # fmt: skip
    assert rc == 0, output
    assert "\x1b" not in output and counts(output, SMALL_FRAMES) == []
    assert screens(output) == [summary_of(output)] and sha256(out) in output


def test_json_is_one_object_with_the_result(worker, small_clip, small_reference, tmp_path):
    npy = small_clip
    local, remote = tmp_path / "local.mp4", worker.outputs / "json.mp4"
    runs = {
        "local": piped("encode", str(npy), str(local), "--fps", "24", *SLOW, "--local", "--json"),
        "worker": piped(
            "encode", str(npy), str(remote), "--fps", "24", *SLOW, "--json", "--url", worker.uds_url
        ),
    }
    # On a terminal too: --json draws no progress.
    rc, shown = on_terminal("decode", str(small_reference), *DECODE, *NO_WORKER, "--json")
    assert rc == 0, shown
    results = {name: json.loads(run.stdout) for name, run in runs.items()}
    assert results["local"]["sha256"] == sha256(local) == sha256(remote)
    assert results["worker"]["sha256"] == sha256(remote) and results["worker"]["ok"] is True
    for result in results.values():
        assert result["frames"] == SMALL_FRAMES and result["route"] == "stream"
        assert result["elapsed_s"] > 0
    decoded = json.loads(shown)
    assert decoded["frames"] == SMALL_DECODED_FRAMES and decoded["source"] == "local"
    assert decoded["bytes"] == SMALL_DECODED_FRAMES * 320 * 180 * 3


def test_local_decode_on_a_terminal_counts_the_memfd_filling(reference, tmp_path):
    npy = tmp_path / "frames.npy"
    rc, output = on_terminal("decode", str(reference), *DECODE, *NO_WORKER, "-o", str(npy))
    assert rc == 0, output
    assert "decoding here" in output
    assert_counted_up(output, DECODED_FRAMES)  # the probed estimate, exact for this file
    last = summary_of(output)
    digest = hashlib.sha256(np.load(npy).tobytes()).hexdigest()
    assert last.startswith(f"{reference}: {DECODED_FRAMES} frames of 320x180"), last
    assert f"sha256 {digest}, from local" in last


def test_worker_decode_on_a_terminal_shows_time_not_a_guess(worker, small_reference):
    args = ["decode", str(small_reference), "--fps", "25", "--size", "320x180"]
    rc, output = on_terminal(*args, "--fd-socket", str(worker.fd_socket), "--no-fallback")
    assert rc == 0, output
    plain = ESCAPE.sub("", output)
    assert "decoding in the worker" in plain and "elapsed" in plain
    assert re.search(r"\d+/\d+ frames", plain) is None  # the worker reports no count
    assert ", from worker, decoded in" in summary_of(output)
