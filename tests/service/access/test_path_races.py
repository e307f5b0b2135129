"""A link on a request's path replaced again and again while the worker resolves it.

Another process swaps, as fast as it can, a symlink in an output root (and one in
an input root) with a real directory (``renameat2(RENAME_EXCHANGE)``: the name
never disappears, it is a link one moment and a directory the next). Each
request must get an answer with a stable code, never a 500.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.support.media import make_clip
from tests.support.processes import framewire_temps
from tests.support.requests import Request, encode_body, wait_for_ffmpeg
from tests.support.worker import metric

# Swaps two names until its parent (the test) is gone or it is killed.
FLIPPER = """\
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
a, b = sys.argv[1].encode(), sys.argv[2].encode()
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(1000):
        if libc.renameat2(-100, a, -100, b, 2) != 0:  # AT_FDCWD, RENAME_EXCHANGE
            raise SystemExit(f"renameat2: {os.strerror(ctypes.get_errno())}")
"""
REQUESTS_S = 4.0


def swapping(root: Path) -> subprocess.Popen[bytes]:
    """``root/link`` (a symlink to ``a``) and ``root/d`` swapped without end; both hold
    ``sub/`` and ``sub/in.wav``."""
    for d in (root / "a", root / "d"):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "in.wav").write_bytes(b"RIFF")
    (root / "link").symlink_to("a")
    return subprocess.Popen([sys.executable, "-c", FLIPPER, str(root / "link"), str(root / "d")])


def test_a_link_swapped_while_paths_are_resolved_is_never_a_500(workers):
    w = workers.start()
    flippers = [swapping(w.outputs), swapping(w.inputs)]
    seen: dict[tuple[int, str], int] = {}
    source = {"kind": "shm", "key": "/framewire-test-none", "dtype": "uint8",
              "shape": [2, 16, 16, 3], "layout": "THWC", "byte_size": 1536}  # fmt: skip
    try:
        with w.http() as h:
            end = time.monotonic() + REQUESTS_S
            while time.monotonic() < end:
                for over in ({}, {"audio": "link/sub/in.wav"}):
                    body = encode_body(source, "link/sub/out.mp4", **over)
                    r = h.post("/v1/videos:encode", json=body)
                    key = (r.status_code, r.json()["code"])
                    seen[key] = seen.get(key, 0) + 1
            assert h.get("/healthz").status_code == 200
    finally:
        for flipper in flippers:
            flipper.kill()
            flipper.wait()
    # The frames are missing (404) once the paths are judged; or a path kept changing.
    assert set(seen) <= {(404, "shm_not_found"), (409, "path_changed")}, seen
    assert seen.get((404, "shm_not_found"), 0) > 0, seen


def test_a_directory_replaced_while_its_output_waits_is_a_409(workers, segments):
    """The directory made (and opened) for an output is replaced by another before the
    output is written: the worker holds the old one, gone from the tree. One CPU slot held
    by a stopped encode keeps the output waiting in between, so the swap always lands."""
    w = workers.start("--cpu-slots", "1", "--small-encode-bytes", "0", "--stall-timeout-s", "120")
    busy = segments.source(make_clip(frames=96, height=128, width=128))
    first = Request(w, "POST", "/v1/videos:encode",
                    json=encode_body(busy, "first.mp4", preset="veryslow"))  # fmt: skip
    [ffmpeg] = wait_for_ffmpeg(w)
    os.kill(ffmpeg, signal.SIGSTOP)
    try:
        small = segments.source(make_clip(frames=2, height=16, width=16))
        second = Request(w, "POST", "/v1/videos:encode", json=encode_body(small, "made/x.mp4"))
        with w.http() as h:
            deadline = time.monotonic() + 30
            while metric(h, "framewire_encodes_waiting") < 1:
                assert time.monotonic() < deadline, "the second output never waited"
                time.sleep(0.02)
        assert (w.outputs / "made").is_dir()  # made and opened for it: then replaced
        (w.outputs / "other").mkdir()
        os.rename(w.outputs / "other", w.outputs / "made")
    finally:
        os.kill(ffmpeg, signal.SIGCONT)
    assert first.result().status_code == 200
    r = second.result()
    assert r.status_code == 409, r.text
    assert r.json()["outputs"][0]["error"]["code"] == "path_changed", r.text
    assert list((w.outputs / "made").iterdir()) == [] and framewire_temps(w.outputs) == []
    with w.http() as h:  # and the worker keeps serving, there too
        assert h.post("/v1/videos:encode", json=encode_body(small, "made/x.mp4")).status_code == 200


def test_a_directory_swapped_for_a_link_while_outputs_are_made_in_it(workers, segments, tmp_path):
    """Outputs go into directories made under ``e`` while ``e`` is swapped with a link to a
    directory outside the roots. Each answer is a write, a refusal of the link, or a race
    (409); never a refusal of the caller's rights (root's here), never a 5xx."""
    w = workers.start()
    (w.outputs / "e").mkdir()
    (tmp_path / "outside").mkdir()
    (w.outputs / "f").symlink_to(tmp_path / "outside")
    flipper = subprocess.Popen([sys.executable, "-c", FLIPPER, str(w.outputs / "e"),
                                str(w.outputs / "f")])  # fmt: skip
    source = segments.source(make_clip(frames=2, height=16, width=16))
    seen: collections.Counter[tuple[int, str]] = collections.Counter()
    end = time.monotonic() + REQUESTS_S * 1.5

    errors: list[BaseException] = []

    def post(k: int) -> None:
        try:
            with w.http() as h:
                n = 0
                while time.monotonic() < end:
                    n += 1
                    body = encode_body(source, f"e/n{k}-{n % 3}/o.mp4")
                    seen[answer_code(h.post("/v1/videos:encode", json=body))] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=post, args=(k,)) for k in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        flipper.kill()
        flipper.wait()
    allowed = {
        (200, "ok"),
        (403, "path_outside_roots"),
        (409, "path_changed"),
        (409, "output_busy"),
    }
    assert set(seen) <= allowed, seen
    assert seen[(200, "ok")] > 0, seen
    assert list((tmp_path / "outside").iterdir()) == []  # nothing went through the link


def answer_code(r: httpx.Response) -> tuple[int, str]:
    """An encode's status and code: the request's, or its output's."""
    if r.status_code == 200:
        return 200, "ok"
    body = r.json()
    if "code" in body:
        return r.status_code, body["code"]
    return r.status_code, body["outputs"][0]["error"]["code"]
