"""The worker's lifecycle: SIGTERM drains within the grace period and stops what outlives
it; a start after a SIGKILL removes the temp files the killed worker left."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.support.media import make_clip
from tests.support.processes import framewire_temps, gone, wait_gone
from tests.support.requests import Request, encode_body, post_raw, wait_for_ffmpeg
from tests.support.worker import Worker


def log_records(worker: Worker) -> list[dict[str, Any]]:
    return [json.loads(line) for line in worker.log.read_text().splitlines() if line.strip()]


def accepting(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def encoding(
    workers, segments, grace: str, frames: int, path: str, preset: str, **kw: Any
) -> tuple[Worker, Request, set[int]]:
    """A worker with this shutdown grace, one encode in flight on it, and that encode's
    ffmpeg: an encode long enough (``frames``, ``preset``) to outlast what comes next."""
    w = workers.start("--shutdown-grace", grace, "--log-format", "json", "--log-level", "info")
    clip = make_clip(frames=frames, height=256, width=256)
    body = encode_body(segments.source(clip), path, preset=preset)
    request = Request(w, "POST", "/v1/videos:encode", json=body, **kw)
    return w, request, wait_for_ffmpeg(w)


def test_sigterm_lets_the_encode_in_flight_finish(workers, segments):
    w, request, ffmpeg = encoding(workers, segments, "30", 96, "done.mp4", "slow")
    w.proc.send_signal(signal.SIGTERM)
    # New connections are refused while it drains (on both HTTP and the fd socket).
    deadline = time.monotonic() + 10
    while accepting(w.uds) or accepting(w.fd_socket):
        assert time.monotonic() < deadline, "still accepting after SIGTERM"
        time.sleep(0.02)
    response = request.result()
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["ok"]
    assert w.proc.wait(timeout=30) == 0
    assert (w.outputs / "done.mp4").stat().st_size > 0
    assert framewire_temps(w.outputs) == []
    wait_gone(ffmpeg)
    messages = [r["message"] for r in log_records(w)]
    assert any("Waiting for connections to close" in m for m in messages), messages


def test_sigterm_past_the_grace_period_stops_the_encode(workers, segments):
    headers = {"x-request-id": "grace-1"}
    w, request, ffmpeg = encoding(
        workers, segments, "0.5", 240, "stopped.mp4", "veryslow", headers=headers
    )
    sent = time.monotonic()
    w.proc.send_signal(signal.SIGTERM)
    response = request.result()
    assert w.proc.wait(timeout=20) == 0
    assert time.monotonic() - sent < 10
    assert response.status_code == 503, response.text
    body = response.json()
    assert body["code"] == "shutting_down"
    assert body["outputs"][0]["error"]["code"] == "shutting_down"
    assert response.headers["x-request-id"] == "grace-1"
    wait_gone(ffmpeg)
    assert not (w.outputs / "stopped.mp4").exists()
    assert framewire_temps(w.outputs) == []
    records = log_records(w)
    stopped = [r for r in records if "stopped: the worker is shutting down" in r["message"]]
    assert [r.get("request_id") for r in stopped] == ["grace-1"], records


def test_ffmpeg_failures_are_logged_with_the_request_id(workers, segments):
    w = workers.start("--log-format", "json")
    (w.inputs / "not-audio.wav").write_bytes(b"not a wav file at all" * 10)
    body = encode_body(segments.source(make_clip()), "a.mp4", audio="not-audio.wav")
    with w.http() as http:
        failed = http.post("/v1/videos:encode", json=body, headers={"x-request-id": "rid-7"})
        generated = http.get("/healthz").headers["x-request-id"]
        replaced = http.get("/healthz", headers={"x-request-id": "no spaces\tplease"})
    assert failed.status_code == 422
    assert failed.headers["x-request-id"] == "rid-7"
    assert len(generated) == 16
    assert replaced.headers["x-request-id"] not in ("no spaces\tplease", generated)
    [record] = [r for r in log_records(w) if r.get("code") == "ffmpeg_failed"]
    assert record["request_id"] == "rid-7"
    assert record["level"] == "WARNING"
    assert record["detail"]  # ffmpeg's stderr tail


def test_start_after_sigkill_removes_the_stale_temp_files(workers, segments):
    w = workers.start()
    clip = make_clip(frames=240, height=256, width=256)
    body = encode_body(segments.source(clip), "killed.mp4", preset="veryslow")
    with post_raw(w.uds, body):
        ffmpeg = wait_for_ffmpeg(w)
        deadline = time.monotonic() + 10
        while not (stale := framewire_temps(w.outputs)):
            assert time.monotonic() < deadline, "no temp file appeared"
            time.sleep(0.02)
        os.kill(w.pid, signal.SIGKILL)
        w.proc.wait()
    for pid in ffmpeg:  # orphaned when the worker died; stop them rather than wait
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)
    wait_gone(ffmpeg)
    assert stale[0].exists()

    keep = w.outputs / "keep.mp4"
    keep.write_bytes(b"a finished output")
    lookalike = w.outputs / ".framewire-tmp-notes.txt"  # not a name the worker makes
    lookalike.write_bytes(b"someone else's")
    live = w.outputs / f".framewire-tmp-{os.getpid()}-{'0' * 16}"  # a live writer's
    live.mkdir(mode=0o700)
    (live / "live.mp4").write_bytes(b"being written")
    link = w.outputs / f".framewire-tmp-{w.pid}-{'1' * 16}"
    link.symlink_to(keep)
    try:
        assert workers.start(root=w.uds.parent).stop() == 0
        assert not any(p.exists() for p in stale)
        assert keep.read_bytes() == b"a finished output"
        assert lookalike.exists() and live.exists() and link.is_symlink()
    finally:
        for path in (lookalike, live / "live.mp4", link):
            path.unlink(missing_ok=True)
        live.rmdir()


def test_stale_temp_sweep_is_conservative(tmp_path):
    from framewire.service._outputs import atomic_output, remove_stale_temps

    dead = subprocess.Popen(["true"])
    dead.wait()

    def temp(directory: Path, pid: int, name: str, mode: int = 0o700) -> Path:
        path = directory / f".framewire-tmp-{pid}-{secrets.token_hex(8)}"
        path.mkdir(parents=True)
        path.chmod(mode)
        (path / name).write_bytes(b"x")
        return path

    removed = [
        temp(tmp_path, dead.pid, "dead.mp4"),
        temp(tmp_path, os.getpid(), "mine.mp4"),  # a previous worker's, same pid as ours
        temp(tmp_path / "a" / "b" / "c" / "d", dead.pid, "deep.mp4"),
    ]
    kept = [
        temp(tmp_path, os.getppid(), "alive.mp4"),
        temp(tmp_path / "a" / "b" / "c" / "d" / "e", dead.pid, "too-deep.mp4"),
        temp(tmp_path, dead.pid, "open.mp4", mode=0o755),  # not a private directory's mode
    ]
    if os.geteuid() == 0:  # someone else's look-alike: only root can make one to test
        theirs = temp(tmp_path, dead.pid, "theirs.mp4")
        os.chown(theirs, 65534, 65534)
        kept.append(theirs)
    nested = temp(tmp_path, dead.pid, "nested.mp4") / "sub"  # holds a directory: not ours
    nested.mkdir()
    plain = tmp_path / f".framewire-tmp-{dead.pid}-{'ab' * 8}"  # a file, not ours
    plain.write_bytes(b"x")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with atomic_output(fd, "writing.mp4") as writing:
            # Our pid, so only its lock shows that a live writer holds it.
            got = remove_stale_temps([str(tmp_path), str(tmp_path)], depth=4)
            assert Path(writing.path).parent.exists()
            raise RuntimeError("stop before the rename")
    except RuntimeError:
        pass
    finally:
        os.close(fd)
    assert sorted(got) == sorted(removed)
    assert all(p.exists() for p in kept) and nested.exists() and plain.exists()
    for path in [*kept, nested.parent]:
        shutil.rmtree(path)
    plain.unlink()


def test_a_stopped_worker_removes_the_socket_files_it_made(workers):
    w = workers.start()
    root = w.uds.parent
    assert w.stop() == 0
    assert not w.uds.exists() and not (root / "fd.sock").exists(), "a socket left behind"
    # The lock files stay (removing one could race a worker starting on it); a new
    # worker takes them over.
    assert (root / "api.sock.lock").exists() and (root / "fd.sock.lock").exists()
    assert workers.start(root=root).stop() == 0


def test_sigterm_lets_a_clients_save_over_64_mib_finish_through_the_worker(workers, tmp_path):
    """A host save over 64 MiB goes as a stream session, chunk by chunk (each over the fd
    socket): SIGTERM once its encoder runs, and the rest of its chunks still reach the
    worker within the grace; the file is the worker's, byte-exact, the worker exits 0."""
    import threading

    from framewire.client import Client

    from tests.support.media import reference_mp4
    from tests.support.requests import RUNNING, wait_for

    w = workers.start("--shutdown-grace", "60")
    clip = make_clip(frames=72, height=480, width=640)  # 265 MB of float32: many chunks
    out: dict[str, Any] = {}

    def save() -> None:
        try:
            with Client(w.uds_url, local_fallback=False) as c:
                out["result"] = c.save_video(clip, "drain.mp4", fps=24, preset="slow")
        except Exception as exc:  # shown below
            out["error"] = exc

    thread = threading.Thread(target=save)
    thread.start()
    wait_for(w, RUNNING, 1)
    w.proc.send_signal(signal.SIGTERM)
    thread.join(timeout=120)
    assert "error" not in out, out
    assert w.proc.wait(timeout=60) == 0
    result = out["result"]
    assert result.route != "local" and (w.outputs / "drain.mp4").exists()
    assert result.sha256 == reference_mp4(clip, tmp_path / "ref.mp4", preset="slow")
    assert framewire_temps(w.outputs) == []
