"""The framewire command, run as a real process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from framewire.client.wire import Layout

from tests.conftest import make_clip, reference_mp4, sha256

CLI = [sys.executable, "-m", "framewire.service"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, env=env)


def test_version_names_ffmpeg():
    out = run("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("framewire 0.1.0")
    assert "ffmpeg version" in out.stdout


def test_info_reports_settings_from_env(tmp_path):
    env = os.environ | {"FRAMEWIRE_CHUNK_BYTES": "12345", "FRAMEWIRE_OUTPUT_ROOTS": "/a,/b"}
    out = run("info", "--cpu-slots", "3", env=env)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["settings"]["chunk_bytes"] == 12345
    assert info["settings"]["output_roots"] == ["/a", "/b"]
    assert info["settings"]["cpu_slots"] == 3
    assert "token" not in info["settings"]


@pytest.mark.parametrize(
    ("dtype", "layout", "extra"),
    [
        (torch.float32, Layout.CTHW, []),
        (torch.float16, Layout.TCHW, ["--layout", "TCHW", "--chunk-bytes", "1"]),
        (torch.uint8, Layout.THWC, ["--layout", "THWC", "--quality", "8", "--preset", "ultrafast"]),
    ],
)
def test_encode_local_is_byte_exact(tmp_path, dtype, layout, extra):
    clip = make_clip(frames=6, height=75, width=100, dtype=dtype, layout=layout)
    np.save(tmp_path / "clip.npy", clip.numpy())
    out = tmp_path / "out.mp4"
    proc = run("encode", str(tmp_path / "clip.npy"), str(out), "--fps", "23.976", "--local", *extra)
    assert proc.returncode == 0, proc.stderr
    kw = {}
    if "--quality" in extra:
        kw = {"quality": 8, "preset": "ultrafast"}
    assert sha256(out) == reference_mp4(clip, tmp_path / "ref.mp4", layout=layout, fps=23.976, **kw)
    assert sha256(out) in proc.stdout


def test_encode_local_with_audio(tmp_path, wav):
    clip = make_clip(frames=24)
    np.save(tmp_path / "clip.npy", clip.numpy())
    out = tmp_path / "out.mp4"
    npy = str(tmp_path / "clip.npy")
    proc = run("encode", npy, str(out), "--fps", "24", "--audio", str(wav), "--local")
    assert proc.returncode == 0, proc.stderr
    assert sha256(out) == reference_mp4(clip, tmp_path / "ref.mp4", audio=wav)


def test_encode_local_errors_are_one_line_and_exit_1(tmp_path):
    np.save(tmp_path / "clip.npy", make_clip(frames=2).numpy())
    out = str(tmp_path / "no" / "o.mp4")
    proc = run("encode", str(tmp_path / "clip.npy"), out, "--fps", "24", "--local")
    assert proc.returncode == 1
    assert "[output_dir_missing]" in proc.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_healthz_on_tcp_and_unix_socket(tmp_path):
    port, uds = free_port(), tmp_path / "api.sock"
    proc = subprocess.Popen(
        [*CLI, "serve", "--port", str(port), "--uds", str(uds), "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not uds.exists():
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "worker did not start"
            time.sleep(0.05)
        time.sleep(0.2)
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").json() == {"status": "ok"}
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(uds))) as c:
            assert c.get("http://framewire/healthz").status_code == 200
            assert "ffmpeg version" in c.get("http://framewire/v1/info").json()["ffmpeg_version"]
        assert oct(uds.stat().st_mode & 0o777) == "0o660"
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0
        if proc.stdout:
            proc.stdout.close()
    assert not Path(uds).exists()
