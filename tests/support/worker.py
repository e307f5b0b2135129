"""A real framewire worker process for tests: started, waited for, stopped."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.http import http_client
from tests.support.processes import child_pids
from tests.support.zygote import Forked, zygote


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Workers are forks of a zygote that has imported the worker once (tests/support/zygote.py);
# FRAMEWIRE_TEST_FORK=0 starts each with its own interpreter instead.
FORK = os.environ.get("FRAMEWIRE_TEST_FORK", "1") != "0"


@dataclass
class Worker:
    proc: subprocess.Popen[bytes] | Forked
    port: int
    uds: Path
    outputs: Path
    inputs: Path
    log: Path

    @property
    def tcp_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def uds_url(self) -> str:
        return f"unix://{self.uds}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def fd_socket(self) -> Path:
        return self.uds.parent / "fd.sock"

    def http(self, token: str | None = None) -> httpx.Client:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return http_client("http://framewire", uds=self.uds, headers=headers, timeout=120)

    def children(self) -> set[int]:
        return child_pids(self.pid)

    def open_fds(self) -> list[str]:
        fds = []
        for fd in os.listdir(f"/proc/{self.pid}/fd"):
            try:
                fds.append(os.readlink(f"/proc/{self.pid}/fd/{fd}"))
            except OSError:
                pass
        return fds

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


# The suite's workers do not yield their encodes (their default): the suite's own
# processes fill both cores, and a niced x264 would crawl behind them, turning every
# bound a test waits for into a race. tests/service/encode/test_yield.py and the ranks
# benchmark start theirs with ``yielding=True``; an env or a flag that sets these wins.
NOT_YIELDING = {"FRAMEWIRE_ENCODE_NICE": "0", "FRAMEWIRE_ENCODE_SCHED": "normal"}


def start_worker(
    root: Path,
    *args: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    yielding: bool = False,
    new_session: bool = False,
    default_roots: bool = False,
) -> Worker:
    """A worker serving ``root``'s outputs and inputs; ``new_session``: started in a session
    of its own, as a service manager starts it (a fresh interpreter, not a fork);
    ``default_roots``: the roots left at their defaults, made by the worker in ``root``
    (its working directory)."""
    outputs, inputs = root / "outputs", root / "inputs"
    if not yielding:
        env = NOT_YIELDING | dict(os.environ if env is None else env)
    roots = ["--output-roots", str(outputs), "--input-roots", str(inputs)]
    if default_roots:
        root.mkdir(parents=True, exist_ok=True)
        roots, cwd = [], root
    else:
        outputs.mkdir(parents=True, exist_ok=True)
        inputs.mkdir(parents=True, exist_ok=True)
    port, uds, log = free_port(), root / "api.sock", root / "worker.log"
    cmd = [
        sys.executable, "-P", "-m", "framewire.service", "serve",
        "--port", str(port), "--uds", str(uds), "--fd-socket", str(root / "fd.sock"),
        *roots, "--log-level", "warning", *args,
    ]  # fmt: skip
    proc: subprocess.Popen[bytes] | Forked
    forks = zygote() if FORK and not new_session else None
    if forks is not None and forks.can_start(env):
        proc = forks.start(cmd[4:], log, env, cwd)  # what follows "-m framewire.service"
    else:
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                    start_new_session=new_session)  # fmt: skip
    worker = Worker(proc, port, uds, outputs, inputs, log)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited {proc.returncode}:\n{log.read_text()}")
        if uds.exists():
            try:
                with worker.http() as c:
                    if c.get("/healthz").status_code == 200:
                        return worker
            except httpx.TransportError:
                pass
        if time.monotonic() > deadline:
            worker.stop()
            raise RuntimeError(f"worker did not start:\n{log.read_text()}")
        time.sleep(0.05)


def metric(http: httpx.Client, name: str) -> float:
    """One unlabelled sample of the worker's /metrics."""
    text = http.get("/metrics").text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found is not None, f"{name} not in /metrics"
    return float(found.group(1))


class Workers:
    """The workers a test (or a module) starts. At its end each one still running is
    stopped with SIGTERM and must exit 0; those the test stopped or killed are its own."""

    def __init__(self, new_root: Callable[[], Path]):
        self._new_root = new_root
        self.started: list[Worker] = []

    def start(
        self,
        *args: str,
        root: Path | None = None,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        yielding: bool = False,
        default_roots: bool = False,
    ) -> Worker:
        worker = start_worker(
            root or self._new_root(),
            *args,
            env=env,
            cwd=cwd,
            yielding=yielding,
            default_roots=default_roots,
        )
        self.started.append(worker)
        return worker

    def stop_all(self) -> None:
        running = [w for w in self.started if w.proc.poll() is None]
        codes = {w.pid: w.stop() for w in running}
        failed = {pid: code for pid, code in codes.items() if code != 0}
        assert not failed, f"workers exited {failed}:\n" + "\n".join(
            w.log.read_text() for w in running if w.pid in failed
        )
