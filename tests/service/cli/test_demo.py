"""``framewire demo``, run as a user would: against a running worker, and with none."""

from __future__ import annotations

import os
import select
import subprocess
import time

from tests.support.cli import CLI, run_cli

DEMO = [*CLI, "demo"]


def test_demo_against_a_running_worker(workers):
    w = workers.start()
    run = run_cli("demo", "--url", w.uds_url, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "every process got the same bytes" in out
    assert out.count("via worker") == 4, out
    assert "1 for 4 requests" in out  # one ffmpeg decode, shared by every process
    assert "open_video: 6 chunks of 8 frames" in out
    assert "the same bytes as save_video" in out  # with its live view on
    assert f"watch it while it is encoded: http://127.0.0.1:{w.port}/v1/streams/" in out
    assert "as sealed memfds over the fd socket" in out
    saved = sorted(p.name for p in (w.outputs / "framewire-demo").iterdir())
    assert len(saved) == 3 and all(name.endswith(".mp4") for name in saved)
    [streamed] = (w.outputs / "framewire-demo").glob("*-a-streamed.mp4")
    [whole] = (w.outputs / "framewire-demo").glob("*-a.mp4")
    assert streamed.read_bytes() == whole.read_bytes()
    assert all(name in out for name in saved)
    assert list(w.inputs.iterdir()) == []  # the reference it wrote is removed again


def test_demo_starts_its_own_worker_when_none_answers(tmp_path):
    run = run_cli("demo", "--url", f"unix://{tmp_path}/nobody.sock", "--frames", "12",
                  "--ranks", "2", timeout=180)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "started one" in run.stdout
    # Its own worker listens on a port the system picked: the URL names that port.
    assert "watch it while it is encoded: http://127.0.0.1:" in run.stdout
    assert "http://127.0.0.1:0/" not in run.stdout
    assert run.stdout.count("via worker") == 2, run.stdout


def test_demo_with_another_workers_fd_socket_in_its_environment(workers, tmp_path):
    """A demo container inherits FRAMEWIRE_FD_SOCKET, the socket of a worker that is not up
    at its URL yet: it starts its own, and never registers frames with the other."""
    other = workers.start()
    env = os.environ | {"FRAMEWIRE_FD_SOCKET": str(other.fd_socket)}
    run = run_cli("demo", "--url", f"unix://{tmp_path}/nobody.sock", "--frames", "12",
                  "--ranks", "2", env=env, timeout=180)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "started one" in run.stdout
    assert "another worker's" in run.stderr  # the inherited socket, passed over and said so
    assert list(other.outputs.iterdir()) == []
    with other.http() as h:
        assert h.get("/v2/systemsharedmemory/status").json() == []


def test_demo_waits_for_its_worker_without_starting_one(workers, tmp_path):
    root = tmp_path / "late"
    demo = subprocess.Popen(
        [
            *DEMO,
            "--url",
            f"unix://{root}/api.sock",
            "--wait",
            "60",
            "--frames",
            "12",
            "--ranks",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Once it says it waits (its first look found nobody), the worker starts.
    assert demo.stderr is not None
    ready, _, _ = select.select([demo.stderr], [], [], 120)
    assert ready, "the demo never said it waits"
    assert demo.stderr.readline().startswith(f"waiting up to 60 s for a worker at unix://{root}/")
    assert demo.poll() is None
    w = workers.start(root=root)
    out, err = demo.communicate(timeout=180)
    assert demo.returncode == 0, out + err
    assert "answered at" in out and "started one" not in out
    assert len(list((w.outputs / "framewire-demo").iterdir())) == 3


def test_demo_that_waits_in_vain_says_so(tmp_path):
    t0 = time.monotonic()
    run = run_cli("demo", "--url", f"unix://{tmp_path}/nobody.sock", "--wait", "1.5", timeout=60)
    assert run.returncode == 1
    assert f"no framewire worker answered at unix://{tmp_path}/nobody.sock within 1.5 s" in (
        run.stderr
    )
    assert 1.5 <= time.monotonic() - t0 < 30
    assert list(tmp_path.iterdir()) == []  # no worker of its own: nothing made
