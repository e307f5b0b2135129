"""Errors nobody planned for, and numbers a dtype cannot hold: a clear answer, and the
keep-alive connection they came on goes on serving."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from tests.support.requests import raw_http
from tests.support.segments import Segments
from tests.support.worker import Worker

# A real worker with one fault injected: reading a stream's state raises. It stands for
# any bug that escapes the handlers (site imports sitecustomize before the worker runs).
INJECT = """\
from framewire.service._stream import sessions

def _broken(self, session_id):
    raise RuntimeError("injected")

sessions.Sessions.state = _broken
"""


def exchange(sock: socket.socket, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send one HTTP/1.1 request on ``sock``; its (status, headers, body)."""
    sock.sendall(request)
    raw = b""
    while b"\r\n\r\n" not in raw:
        got = sock.recv(65536)
        assert got, f"the connection was closed before an answer: {raw!r}"
        raw += got
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", "0")):
        got = sock.recv(65536)
        assert got, "the connection was closed inside an answer"
        body += got
    return int(lines[0].split()[1]), headers, body


def get(path: str) -> bytes:
    return raw_http("GET", path)


def post(path: str, body: dict[str, object]) -> bytes:
    return raw_http("POST", path, body)


def test_a_500_keeps_the_keep_alive_connection(workers, tmp_path: Path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(INJECT)
    w = workers.start(env=os.environ | {"PYTHONPATH": str(site)})
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(str(w.uds))
        status, headers, body = exchange(sock, get("/v1/streams/0123456789abcdef"))
        assert (status, json.loads(body)["code"]) == (500, "internal")
        assert headers.get("connection") != "close"
        # The next request on the same connection is served.
        status, _, body = exchange(sock, get("/healthz"))
        assert status == 200, body
    assert "RuntimeError: injected" in w.log.read_text()  # reported, as a 500 must be


@pytest.mark.parametrize(
    ("dtype", "value_range"),
    [
        ("float32", [-1e39, 1e39]),  # past float32: torch cannot clamp to it
        ("float16", [-1e5, 1e5]),  # past float16's 65504
        ("bfloat16", [0, 1e39]),
    ],
)
def test_a_value_range_the_dtype_cannot_hold_is_a_400(
    worker: Worker, segments: Segments, dtype: str, value_range: list[float]
):
    import torch

    clip = torch.zeros((3, 2, 16, 16), dtype=getattr(torch, dtype))
    output = {"source": segments.source(clip), "path": "vr/x.mp4", "fps": 24,
              "profile": "vllm-omni", "value_range": value_range}  # fmt: skip
    stream = {"path": "vr/s.mp4", "fps": 24, "dtype": dtype, "height": 16, "width": 16,
              "profile": "vllm-omni", "value_range": value_range}  # fmt: skip
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(60)
        sock.connect(str(worker.uds))
        for request in (post("/v1/videos:encode", {"outputs": [output]}),
                        post("/v1/streams", stream)):  # fmt: skip
            status, _, body = exchange(sock, request)
            assert (status, json.loads(body)["code"]) == (400, "bad_value_range"), body
        assert exchange(sock, get("/healthz"))[0] == 200  # the same connection goes on
    assert not (worker.outputs / "vr").exists()
