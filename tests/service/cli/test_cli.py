"""The framewire command, run as a real process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from framewire.client.wire import Layout

from tests.support.cli import run_cli, start_cli
from tests.support.http import http_client, http_get
from tests.support.identity import NOBODY
from tests.support.media import make_clip, reference_mp4, sha256


def test_version_names_ffmpeg():
    out = run_cli("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("framewire 0.1.0")
    assert "ffmpeg version" in out.stdout


def test_info_reports_settings_from_env(tmp_path):
    env = os.environ | {"FRAMEWIRE_CHUNK_BYTES": "12345", "FRAMEWIRE_OUTPUT_ROOTS": "/a,/b"}
    out = run_cli("info", "--cpu-slots", "3", env=env)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["settings"]["chunk_bytes"] == 12345
    assert info["settings"]["output_roots"] == ["/a", "/b"]
    assert info["settings"]["cpu_slots"] == 3
    assert "token" not in info["settings"]


def _cgroup_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")


@pytest.mark.parametrize(
    ("membership", "files", "limit"),
    [
        # v2: the tightest of the process's group and its ancestors; "max" is none.
        ("0::/pods/a/worker", {"pods/a/worker/memory.max": "max", "pods/a/memory.max": "4096",
                               "pods/memory.max": "8192", "memory.max": "max"}, 4096),
        ("0::/", {"memory.max": "2048"}, 2048),  # a container's own cgroup namespace
        ("0::/", {"unified/memory.max": "1024"}, 1024),  # hybrid host
        # v1, with other controllers on the same line
        ("5:cpu,cpuacct:/x\n4:memory:/docker/c1", {"memory/docker/c1/memory.limit_in_bytes":
                                                    "9223372036854771712",
                                                    "memory/docker/memory.limit_in_bytes":
                                                    "3072"}, 3072),
        ("0::/", {"memory.max": "max"}, None),
        ("0::/gone", {}, None),
    ],
)  # fmt: skip
def test_memory_budgets_follow_the_cgroup_limit(tmp_path, membership, files, limit):
    from framewire.service._ops.limits import cgroup_memory_limit, usable_memory

    root = tmp_path / "cgroup"
    root.mkdir()
    _cgroup_tree(root, files)
    (tmp_path / "self").write_text(membership + "\n")
    assert cgroup_memory_limit(tmp_path / "self", root) == limit
    assert cgroup_memory_limit(tmp_path / "missing", root) is None
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < usable_memory() <= ram


def test_decode_budgets_default_to_an_eighth_of_the_cgroup_limit(monkeypatch):
    from framewire.service._ops import limits
    from framewire.service._settings import Settings

    monkeypatch.setattr(limits, "cgroup_memory_limit", lambda: 800 << 20)
    defaults = Settings()
    assert defaults.decode_cache_bytes == defaults.max_decode_bytes == 100 << 20


@pytest.mark.parametrize(
    ("membership", "files", "cpus"),
    [
        ("0::/pods/w", {"pods/w/cpu.max": "max 100000", "pods/cpu.max": "250000 100000"}, 2.5),
        ("0::/", {"cpu.max": "max 100000"}, None),
        ("0::/", {"cpu.max": "garbage"}, None),
        ("2:cpu,cpuacct:/docker/c1\nnot a cgroup line",
         {"cpu,cpuacct/docker/c1/cpu.cfs_quota_us": "150000",
          "cpu,cpuacct/docker/c1/cpu.cfs_period_us": "100000",
          "cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000"}, 1.5),
    ],
)  # fmt: skip
def test_cpu_quota_is_read_and_warned_about(tmp_path, monkeypatch, membership, files, cpus):
    from framewire.service._ops import limits

    root = tmp_path / "cgroup"
    root.mkdir()
    _cgroup_tree(root, files)
    (tmp_path / "self").write_text(membership + "\n")
    assert limits.cgroup_cpu_limit(tmp_path / "self", root) == cpus
    monkeypatch.setattr(limits, "cgroup_cpu_limit", lambda: cpus)
    note = limits.cpu_quota_note(cpu_slots=8)
    if cpus is None:
        assert note is None
    else:
        assert note is not None and f"FRAMEWIRE_CPU_SLOTS={int(cpus)}" in note
        assert limits.cpu_quota_note(cpu_slots=int(cpus) + 1) is None  # within the quota


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
    proc = run_cli(
        "encode", str(tmp_path / "clip.npy"), str(out), "--fps", "23.976", "--local", *extra
    )
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
    proc = run_cli("encode", npy, str(out), "--fps", "24", "--audio", str(wav), "--local")
    assert proc.returncode == 0, proc.stderr
    assert sha256(out) == reference_mp4(clip, tmp_path / "ref.mp4", audio=wav)


@pytest.mark.parametrize("local", [True, False])
def test_encode_takes_a_fractional_quality_and_a_profile(tmp_path, local, worker):
    from tests.support.engines import sglang_save

    clip = make_clip(frames=6, height=30, width=34)
    np.save(tmp_path / "clip.npy", clip.numpy())
    out = tmp_path / "out.mp4" if local else worker.outputs / "cli-sglang.mp4"
    where = ["--local"] if local else ["--url", worker.uds_url, "--worker-only"]
    proc = run_cli("encode", str(tmp_path / "clip.npy"), str(out), "--fps", "23.976",
               "--quality", "5.5", "--profile", "sglang", *where)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert local or ", route stream, " in proc.stdout, proc.stdout  # the worker's
    want = sglang_save(clip, tmp_path / "ref.mp4", fps=23.976, output_compression=55)
    assert sha256(out) == want


def test_encode_local_errors_are_one_line_and_exit_1(tmp_path):
    np.save(tmp_path / "clip.npy", make_clip(frames=2).numpy())
    out = str(tmp_path / "no" / "o.mp4")
    proc = run_cli("encode", str(tmp_path / "clip.npy"), out, "--fps", "24", "--local")
    assert proc.returncode == 1
    assert "[output_dir_missing]" in proc.stderr


@pytest.mark.parametrize("where", [["--local"], ["--url", "unix:///nonexistent/api.sock"]])
def test_encode_refuses_a_clip_without_frames_in_one_line(tmp_path, where):
    np.save(tmp_path / "empty.npy", np.zeros((3, 0, 16, 16), np.float32))
    proc = run_cli(
        "encode", str(tmp_path / "empty.npy"), str(tmp_path / "o.mp4"), "--fps", "24", *where
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == f"framewire: [bad_shape] {tmp_path / 'empty.npy'} holds no frames"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_healthz_on_tcp_and_unix_socket(tmp_path):
    port, uds, log = free_port(), tmp_path / "api.sock", tmp_path / "serve.log"
    proc = start_cli("serve", "--port", str(port), "--uds", str(uds), "--log-level", "warning",
                     stdio=(os.devnull, str(log), str(log)))  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not uds.exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "worker did not start"
            time.sleep(0.05)
        while True:  # the Unix socket is bound before the TCP listener is served
            try:
                healthz = http_get(f"http://127.0.0.1:{port}/healthz")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "TCP never answered"
                time.sleep(0.05)
        assert healthz.json() == {"status": "ok"}
        with http_client(uds=str(uds)) as c:
            assert c.get("http://framewire/healthz").status_code == 200
            assert "ffmpeg version" in c.get("http://framewire/v1/info").json()["ffmpeg_version"]
        assert oct(uds.stat().st_mode & 0o777) == "0o660"
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0, log.read_text()
    assert not Path(uds).exists()


def serve_refused(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """``framewire serve`` that must refuse to start: its stderr (a worker that serves
    instead is stopped, and fails the test)."""
    roots = ["--output-roots", str(tmp_path), "--input-roots", str(tmp_path)]
    err = tmp_path / "serve.stderr"
    proc = start_cli("serve", "--port", "0", "--log-level", "warning", *roots, *args,
                     stdio=(os.devnull, os.devnull, str(err)), env=env)  # fmt: skip
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.wait(timeout=30)
        pytest.fail(f"the worker started (and was stopped): {err.read_text()}")
    stderr = err.read_text()
    assert code == 1, stderr
    assert "not starting" in stderr, stderr
    return stderr


MADE = {"nobodys": (NOBODY, 0o777), "nobodys-private": (NOBODY, 0o700), "open": (0, 0o777)}


@pytest.mark.parametrize("made", MADE.values(), ids=MADE.keys())
def test_serve_refuses_a_runtime_directory_that_is_not_its_own(tmp_path, made):
    """The default runtime directory ($XDG_RUNTIME_DIR/framewire here, the same check as
    /tmp/framewire-<uid>) that another user made first, or that every user may write
    to, is refused, named, and left as it was."""
    owner, mode = made
    runtime = tmp_path / "framewire"
    runtime.mkdir()
    os.chown(runtime, owner, owner)
    runtime.chmod(mode)
    env = os.environ | {"XDG_RUNTIME_DIR": str(tmp_path)}  # its framewire/ is the default
    for configured in ("FRAMEWIRE_UDS", "FRAMEWIRE_FD_SOCKET"):
        env.pop(configured, None)
    stderr = serve_refused(tmp_path, env=env)
    assert f"directory {runtime} " in stderr
    assert ("belongs to uid 65534" if owner else "writable by every user") in stderr
    assert list(runtime.iterdir()) == []  # no socket, no lock made in it


def test_serve_does_not_follow_a_link_planted_as_its_lock(tmp_path):
    runtime, target = tmp_path / "run", tmp_path / "planted"
    runtime.mkdir(mode=0o700)
    (runtime / "api.sock.lock").symlink_to(target)
    stderr = serve_refused(
        tmp_path, "--uds", str(runtime / "api.sock"), "--fd-socket", str(runtime / "fd.sock")
    )
    assert f"{runtime / 'api.sock.lock'} is a symbolic link" in stderr
    assert not target.exists()
    assert sorted(p.name for p in runtime.iterdir()) == ["api.sock.lock"]
