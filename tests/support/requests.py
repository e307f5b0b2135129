"""Requests against a real worker: encode bodies, requests on threads, what it holds after."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from framewire.client import Client

from tests.support.media import make_clip, reference_mp4
from tests.support.processes import framewire_temps
from tests.support.segments import Segments
from tests.support.worker import Worker, metric


def encode_body(source: dict[str, Any], path: str, **over: Any) -> dict[str, Any]:
    return {"outputs": [{"source": source, "path": path, "fps": 24} | over]}


class Request(threading.Thread):
    """One HTTP request to the worker on its own thread; ``response`` once it returns."""

    def __init__(self, worker: Worker, method: str, path: str, **kw: Any):
        super().__init__(daemon=True)
        self.worker, self.method, self.path, self.kw = worker, method, path, kw
        self.response: httpx.Response | None = None
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            with self.worker.http() as http:
                self.response = http.request(self.method, self.path, **self.kw)
        except Exception as exc:
            self.error = exc

    def result(self, timeout: float = 60) -> httpx.Response:
        self.join(timeout)
        assert not self.is_alive(), "the request did not return"
        assert self.response is not None, self.error
        return self.response


def raw_http(method: str, path: str, body: Any = None) -> bytes:
    """One HTTP/1.1 request as bytes, for a socket the test drives itself (JSON body)."""
    data = b"" if body is None else json.dumps(body).encode()
    head = f"{method} {path} HTTP/1.1\r\nhost: framewire\r\n"
    if body is not None:
        head += f"content-type: application/json\r\ncontent-length: {len(data)}\r\n"
    return (head + "\r\n").encode() + data


def post_raw(uds: Path, body: dict[str, Any]) -> socket.socket:
    """An encode sent on a Unix socket of its own, left for the test to read or to close
    (a close is the client going away mid-request)."""
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(str(uds))
    sock.sendall(raw_http("POST", "/v1/videos:encode", body))
    return sock


def wait_for_ffmpeg(worker: Worker, timeout: float = 20, naming: str | None = None) -> set[int]:
    """The worker's children once it has one (``naming``: one whose argv names it, not
    another child: a request may start a binary's ``-version`` check first)."""
    deadline = time.monotonic() + timeout
    while not (pids := {p for p in worker.children() if _names(p, naming)}):
        assert worker.proc.poll() is None, worker.log.read_text()
        assert time.monotonic() < deadline, "ffmpeg never started"
        time.sleep(0.02)
    return pids


def _names(pid: int, naming: str | None) -> bool:
    if naming is None:
        return True
    try:
        return naming.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False  # gone already


def shm_names() -> set[str]:
    """The /dev/shm names this test process may have made: the client's (named after the
    pid that made them: this process, its descendants, or one that died) and
    tests.support.segments' (after this process). The suite's other processes (pytest -n)
    make and remove theirs meanwhile."""
    others = other_test_processes()
    names = set()
    for name in os.listdir("/dev/shm"):
        made_by = re.match(r"framewire-(?:test-)?(\d+)-", name)
        if made_by is not None and int(made_by.group(1)) not in others:
            names.add(name)
    return names


def other_test_processes() -> set[int]:
    """The pids of the suite's other processes and of everything they started."""
    mine = os.getpid()
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    siblings = {pid for pid, parent in parents.items() if parent == parents.get(mine) != 1}
    others = siblings - {mine}
    grown = True
    while grown:
        more = {pid for pid, parent in parents.items() if parent in others} - others
        others |= more
        grown = bool(more)
    return others


@dataclass
class Baseline:
    """What a warmed-up worker holds: fds (decode-cache and staging memfds apart), the
    staging memfds in use (not kept between encodes), and /dev/shm names."""

    fds: int
    shm: set[str]
    staging: int = 0

    @classmethod
    def of(cls, worker: Worker) -> Baseline:
        with worker.http() as http:
            staging = staging_in_use(worker, http)
        return cls(len(_other_fds(worker)), shm_names(), staging)


KEPT = ("/memfd:framewire-decode", "/memfd:framewire-staging")  # counted against their gauges


def _other_fds(worker: Worker) -> list[str]:
    return [f for f in worker.open_fds() if not f.startswith(KEPT)]


def staging_memfds(worker: Worker) -> int:
    """Staging memfds the worker holds open (each by two fds: its own, and its mapping's)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{worker.pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{worker.pid}/fd/{fd}").startswith("/memfd:framewire-staging"):
                inodes.add(os.stat(f"/proc/{worker.pid}/fd/{fd}").st_ino)
    return len(inodes)


def staging_in_use(worker: Worker, http: httpx.Client) -> int:
    """Staging memfds the worker holds beyond those it keeps between encodes
    (``framewire_staging_kept``): the running encodes' and open sessions', or leaked."""
    return staging_memfds(worker) - int(metric(http, "framewire_staging_kept"))


def staging_unaccounted(worker: Worker, http: httpx.Client, in_use: int = 0) -> str | None:
    """A problem to report if more staging memfds are in use than ``in_use``."""
    held = staging_in_use(worker, http)
    return None if held <= in_use else f"{held} staging memfds in use (not kept), {in_use} before"


def settle(
    worker: Worker, baseline: Baseline, keep: set[str] = frozenset(), timeout: float = 10
) -> None:
    """Wait until the worker holds no more than ``baseline`` (its decode cache apart), runs
    no child, and neither temp outputs nor new shm segments (but ``keep``) are left."""
    deadline = time.monotonic() + timeout
    while True:
        problems = []
        fds = _other_fds(worker)
        if len(fds) > baseline.fds:
            problems.append(f"fds {len(fds)} > {baseline.fds}: {fds}")
        with worker.http() as http:
            cached = metric(http, "framewire_decode_cache_entries")
            staging = staging_unaccounted(worker, http, baseline.staging)
        decode_fds = sum(f.startswith(KEPT[0]) for f in worker.open_fds())
        if decode_fds > cached:
            problems.append(f"{decode_fds} decode memfds open for {cached:.0f} cached decodes")
        if children := worker.children():
            problems.append(f"children {children}")
        if staging is not None:
            problems.append(staging)
        if temps := framewire_temps(worker.outputs):
            problems.append(f"temp outputs {temps}")
        if shm := shm_names() - baseline.shm - {k.lstrip("/") for k in keep}:
            problems.append(f"shm segments {shm}")
        if not problems:
            return
        if time.monotonic() > deadline:
            pytest.fail("leaked: " + "; ".join(problems))
        time.sleep(0.05)


def still_serving(worker: Worker, segments: Segments, tmp_path: Path) -> None:
    """A small encode right after the fault: answered, and byte-exact. Just past the small
    lane's size (278 KiB of rgb24 frames): it needs a CPU slot, so a slot never given back
    shows as a wait that never ends."""
    clip = make_clip(frames=3, height=176, width=176, seed=7)
    with worker.http() as http:
        r = http.post("/v1/videos:encode", json=encode_body(segments.source(clip), "after.mp4"))
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["sha256"] == reference_mp4(clip, tmp_path / "after-ref.mp4")
    (worker.outputs / "after.mp4").unlink()


WAITING, RUNNING = "framewire_encodes_waiting", "framewire_encodes_in_flight"


def wait_for(w: Worker, name: str, value: float, timeout: float = 30) -> None:
    """Until the worker's metric ``name`` reaches ``value``."""
    deadline = time.monotonic() + timeout
    with w.http() as h:
        while metric(h, name) < value:
            assert time.monotonic() < deadline, f"{name} never reached {value}"
            time.sleep(0.01)


def saved_on_thread(
    w: Worker, clip: Any, path: str, out: dict[str, Any], **kw: Any
) -> threading.Thread:
    """``save_video`` of ``clip`` (1 x264 thread) on a thread; its result into ``out[path]``."""

    def run() -> None:
        with Client(w.uds_url) as c:
            out[path] = c.save_video(clip, path, fps=24, threads=1, **kw).model_dump()

    thread = threading.Thread(target=run)
    thread.start()
    return thread
