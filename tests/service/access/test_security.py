"""Hostile callers against a real worker: paths, shm keys, tokens, peers, sizes, shapes.

Every refusal is checked the same way: the status and the stable code, no new
file anywhere under the output root (or beside it), and ``/healthz`` still
answering afterwards.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from framewire.core.errors import Forbidden
from framewire.service._access.paths import open_output_dir, resolve_output
from framewire.service._outputs import atomic_output

from tests.support.http import http_client
from tests.support.refclips import RawConnection
from tests.support.segments import Segments
from tests.support.worker import Worker

TOKEN = "s3cret-" + "x" * 16
FRAMES, HEIGHT, WIDTH = 2, 16, 16
NBYTES = 3 * FRAMES * HEIGHT * WIDTH
JSON = {"content-type": "application/json"}


WORKER_ARGS = (
    "--token",
    TOKEN,
)  # the module's worker (tests/conftest.py)


@pytest.fixture
def segment(segments: Segments) -> Callable[..., str]:
    """A segment of ``size`` patterned bytes under ``prefix``; returns its key."""

    def make(size: int = NBYTES, prefix: str = "/framewire-test-") -> str:
        return segments.write(bytes(range(256)) * (size // 256) + b"\0" * (size % 256), prefix)

    return make


def source(key: str, **over: object) -> dict[str, object]:
    src: dict[str, object] = {
        "kind": "shm",
        "key": key,
        "offset": 0,
        "byte_size": NBYTES,
        "dtype": "uint8",
        "shape": [3, FRAMES, HEIGHT, WIDTH],
        "layout": "CTHW",
    }
    return src | over


def one(src: dict[str, object], path: str = "out.mp4", **kw: object) -> dict[str, object]:
    return {"outputs": [{"source": src, "path": path, "fps": 24} | kw]}


def tree(*roots: Path) -> set[Path]:
    return {p for root in roots for p in root.rglob("*")}


def healthy(worker: Worker) -> None:
    with worker.http() as h:
        assert h.get("/healthz").status_code == 200
    assert worker.proc.poll() is None


def refused(
    worker: Worker,
    body: dict[str, object] | bytes,
    status: int,
    code: str,
    *,
    token: str | None = TOKEN,
    watch: tuple[Path, ...] = (),
    url: str = "/v1/videos:encode",
) -> None:
    """``body`` gets ``status`` with ``code``, leaves no file, and the worker keeps serving."""
    before = tree(worker.outputs, *watch)
    with worker.http(token) as h:
        if isinstance(body, bytes):
            r = h.post(url, content=body, headers=JSON)
        else:
            r = h.post(url, json=body)
    assert (r.status_code, r.json().get("code")) == (status, code), r.text
    assert r.json()["error"]
    assert tree(worker.outputs, *watch) == before, "a refused request left a file"
    healthy(worker)


# --- paths ---------------------------------------------------------------------------------


def test_traversal_and_absolute_paths_are_refused(worker, segment, tmp_path):
    ok = source(segment())
    for path in (
        "../evil.mp4",
        "a/../../evil.mp4",
        "a/b/../../../evil.mp4",
        f"{worker.outputs}/../evil.mp4",
        "/etc/evil.mp4",
        "/dev/shm/evil.mp4",
        str(tmp_path / "evil.mp4"),
    ):
        code = "path_traversal" if ".." in path else "path_outside_roots"
        refused(worker, one(ok, path=path), 403, code, watch=(tmp_path,))
    refused(worker, one(ok, path="evil\x00.mp4"), 400, "bad_path")
    refused(worker, one(ok, path="."), 403, "path_outside_roots")  # the root itself
    assert not (worker.outputs.parent / "evil.mp4").exists()


def test_names_no_file_system_takes_are_bad_requests(worker, segment):
    """Found by hand while checking the fuzz suite: these reached a system call as a 500."""
    ok = source(segment())
    (worker.outputs / "file.mp4").write_bytes(b"x")
    try:
        refused(worker, one(ok, path="a" * 300 + ".mp4"), 400, "bad_path")  # ENAMETOOLONG
        refused(worker, one(ok, path="file.mp4/x.mp4"), 400, "bad_path")  # ENOTDIR
        # A lone surrogate: valid JSON ("\ud800"), but no file name.
        raw = b'{"paths": ["\\ud800.mp4"]}'
        refused(worker, raw, 400, "bad_path", url="/v1/probe")
        raw = json.dumps(one(ok, path="x.mp4")).replace("x.mp4", "\\ud800.mp4").encode()
        refused(worker, raw, 400, "bad_path")
        for key in ("/framewire\x00a", "/framewire\ud800"):
            body = json.dumps({"key": key, "byte_size": 1}).encode()
            refused(
                worker, body, 400, "bad_shm_key", url="/v2/systemsharedmemory/region/x/register"
            )
    finally:
        (worker.outputs / "file.mp4").unlink()


def test_symlinks_out_of_the_root_are_refused(worker, segment, tmp_path):
    ok = source(segment())
    outside = tmp_path / "outside"
    outside.mkdir()
    links = [
        (worker.outputs / "escape", outside),  # a directory link
        (worker.outputs / "hop", worker.outputs / "escape"),  # a link to that link
        (worker.outputs / "file.mp4", outside / "target.mp4"),  # a dangling file link
        (worker.outputs / "inside.mp4", worker.outputs / "real.mp4"),  # even one inside
    ]
    (worker.outputs / "nest").mkdir()
    links.append((worker.outputs / "nest" / "deep", outside))
    for link, target in links:
        link.symlink_to(target)
    try:
        for path in ("escape/evil.mp4", "hop/evil.mp4", "nest/deep/evil.mp4", "escape/new/x.mp4"):
            refused(worker, one(ok, path=path), 403, "path_outside_roots", watch=(outside,))
        for path in ("file.mp4", "inside.mp4"):
            refused(worker, one(ok, path=path), 403, "path_outside_roots", watch=(outside,))
        # inputs too: an audio link out of the input root
        (worker.inputs / "a.wav").symlink_to("/etc/passwd")
        refused(worker, one(ok, audio="a.wav"), 403, "path_outside_roots")
        refused(worker, one(ok, audio="/etc/passwd"), 403, "path_outside_roots")
        refused(worker, one(ok, audio="../outputs/x.wav"), 403, "path_traversal")
        assert list(outside.iterdir()) == []
    finally:
        for link, _ in links:
            link.unlink()
        (worker.inputs / "a.wav").unlink(missing_ok=True)
        (worker.outputs / "nest").rmdir()


def test_output_that_is_a_directory_or_a_device_is_refused(worker, segment):
    ok = source(segment())
    (worker.outputs / "adir.mp4").mkdir()
    os.mkfifo(worker.outputs / "pipe.mp4")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(worker.outputs / "sock.mp4"))
    try:
        for name in ("adir.mp4", "pipe.mp4", "sock.mp4"):
            refused(worker, one(ok, path=name), 400, "output_not_a_file")
            refused(worker, one(ok, path=str(worker.outputs / name)), 400, "output_not_a_file")
        assert list((worker.outputs / "adir.mp4").iterdir()) == []
    finally:
        sock.close()
        (worker.outputs / "adir.mp4").rmdir()
        (worker.outputs / "pipe.mp4").unlink()
        (worker.outputs / "sock.mp4").unlink()


def test_directory_swapped_for_a_symlink_after_the_check(tmp_path):
    """The window between the path check and the open, made deterministic in-process.

    Only a caller that can write inside an output root can swap a directory there.
    """
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    target = resolve_output("sub/out.mp4", [str(root)])  # judged: inside the root
    (root / "sub").rmdir()
    (root / "sub").symlink_to(outside)  # swapped before the worker opens it
    with pytest.raises(Forbidden) as err:
        open_output_dir(target, [str(root)])
    assert err.value.code == "path_outside_roots"
    assert list(outside.iterdir()) == []


def test_missing_directories_are_made_without_following_links(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    target = resolve_output("a/b/out.mp4", [str(root)])  # a/ and b/ do not exist yet
    (root / "a").symlink_to(outside)  # appears before they are made
    with pytest.raises(Forbidden):
        open_output_dir(target, [str(root)])
    assert list(outside.iterdir()) == []
    (root / "a").unlink()
    fd = open_output_dir(target, [str(root)])
    os.close(fd)
    assert (root / "a" / "b").is_dir() and not (root / "a").is_symlink()


def test_swaps_while_the_output_is_written(tmp_path):
    """Once opened, the directory is used by fd: moving it away and linking its old
    name elsewhere, or linking the output's own name, moves nothing out of the root."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "victim").write_bytes(b"keep")
    target = resolve_output("sub/out.mp4", [str(root)])
    fd = open_output_dir(target, [str(root)])
    try:
        with atomic_output(fd, target.name) as temp:
            (root / "sub").rename(root / "moved")
            (root / "sub").symlink_to(outside)
            (root / "moved" / "out.mp4").symlink_to(outside / "victim")
            Path(temp.path).write_bytes(b"data")  # what ffmpeg does, by name
    finally:
        os.close(fd)
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert (outside / "victim").read_bytes() == b"keep"
    assert (root / "moved" / "out.mp4").read_bytes() == b"data"  # the link was replaced
    assert [p.name for p in (root / "moved").iterdir()] == ["out.mp4"]  # no private dir left


def test_private_directory_is_the_workers_alone(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with atomic_output(fd, "out.mp4") as temp:
            private = Path(temp.path).parent.resolve()
            assert private.parent == tmp_path and stat.S_IMODE(private.stat().st_mode) == 0o700
            raise RuntimeError("abandon the write")
    except RuntimeError:
        pass
    finally:
        os.close(fd)
    assert list(tmp_path.iterdir()) == []


# --- shared memory -------------------------------------------------------------------------


def test_shm_keys_outside_the_prefixes(worker, segment):
    other = segment(prefix="/elsewhere-")
    refused(worker, one(source(other)), 403, "shm_prefix")
    # a refusal after the path was judged makes no directories for the output either
    refused(worker, one(source(other), path="new/dir/x.mp4"), 403, "shm_prefix")
    refused(worker, one(source("/framewire-test-none"), path="new/x.mp4"), 404, "shm_not_found")
    for key in ("/dev/shm/x", "framewire-x", "/../etc/passwd", "/framewire/../x", "/"):
        refused(worker, one(source(key)), 400, "bad_shm_key")
    # a link inside /dev/shm with an allowed name is not followed
    link = f"/framewire-test-link-{secrets.token_hex(4)}"
    os.symlink(f"/dev/shm{other}", f"/dev/shm{link}")
    try:
        refused(worker, one(source(link)), 403, "shm_denied")
    finally:
        os.unlink(f"/dev/shm{link}")
    # a region can be registered only over an allowed key
    body = {"key": other, "offset": 0, "byte_size": NBYTES}
    refused(worker, body, 403, "shm_prefix", url="/v2/systemsharedmemory/region/r1/register")


# --- authentication ------------------------------------------------------------------------


def test_missing_or_wrong_token_is_unauthorized(worker, segment):
    ok = one(source(segment()))
    refused(worker, ok, 401, "unauthorized", token=None)
    refused(worker, ok, 401, "unauthorized", token="wrong")
    refused(worker, ok, 401, "unauthorized", token=TOKEN + "x")
    refused(worker, ok, 401, "unauthorized", token=TOKEN[:-1])
    with http_client(worker.tcp_url, timeout=30) as h:
        for headers in ({}, {"authorization": TOKEN}, {"authorization": "Basic " + TOKEN}):
            r = h.post("/v1/videos:encode", json=ok, headers=headers)
            assert (r.status_code, r.json()["code"]) == (401, "unauthorized")
            assert h.get("/v1/info", headers=headers).status_code == 401
        assert h.get("/healthz").status_code == 200
    healthy(worker)


def test_fd_socket_peer_with_a_disallowed_uid(workers):
    w = workers.start("--allowed-uids", "12345")
    (w.inputs / "v.mp4").write_bytes(b"not a video")
    decode = {"op": "decode", "path": str(w.inputs / "v.mp4"), "fps": 5}
    for message in (
        {"op": "ping"},
        decode | {"width": 8, "height": 8},
        b"{not json\n",
        b"x" * (100 << 10) + b"\n",
    ):
        with RawConnection(w.fd_socket) as conn:
            header, fds = conn.call(message)
            assert (header["ok"], header["code"], fds) == (False, "forbidden", [])
            assert conn.sock.recv(1) == b""  # told once, then closed
    assert tree(w.outputs) == set()
    healthy(w)


# --- sizes and shapes ----------------------------------------------------------------------


def test_huge_http_body_is_refused_and_the_worker_keeps_serving(worker, segment):
    big = json.dumps(one(source(segment())) | {"pad": "x" * (50 << 20)}).encode()
    before = tree(worker.outputs)
    with worker.http(TOKEN) as h:
        r = h.post("/v1/videos:encode", content=big, headers=JSON)
        # Refused from its Content-Length, before it is read.
        assert (r.status_code, r.json()["code"]) == (413, "body_too_large"), r.text[:200]

        # Chunked, so no Content-Length to go by: refused once the limit is passed.
        def chunks() -> Iterator[bytes]:
            for at in range(0, len(big), 1 << 16):
                yield big[at : at + (1 << 16)]

        r = h.post("/v1/videos:encode", content=chunks(), headers=JSON)
        assert (r.status_code, r.json()["code"]) == (413, "body_too_large"), r.text[:200]
        assert "FRAMEWIRE_MAX_BODY_BYTES" in r.json()["error"]
    assert tree(worker.outputs) == before
    healthy(worker)
    # Deeply nested JSON, under the body limit: a 400 with a code, not a 5xx.
    with worker.http(TOKEN) as h:
        r = h.post("/v1/videos:encode", content=b"[" * 100_000 + b"]" * 100_000, headers=JSON)
        assert (r.status_code, r.json()["code"]) == (400, "bad_request"), r.text[:200]
    assert tree(worker.outputs) == before
    healthy(worker)


def test_oversized_fd_socket_line_is_refused(worker):
    fd_sock = worker.uds.parent / "fd.sock"
    with RawConnection(fd_sock) as conn:
        header, fds = conn.call(b'{"op": "ping", "pad": "' + b"y" * (1 << 20) + b'"}\n')
        assert (header["ok"], header["code"], fds) == (False, "bad_request", [])
        assert conn.call({"op": "ping"})[0]["ok"] is True
        # nested deeper than the JSON parser's stack, yet well under the line limit
        header, fds = conn.call(b"[" * 60_000 + b"\n")
        assert (header["ok"], header["code"], fds) == (False, "bad_request", [])
        assert conn.call({"op": "ping"})[0]["ok"] is True
    healthy(worker)


@pytest.mark.parametrize(
    ("shape", "byte_size", "code"),
    [
        ([3, 2**40, 2**20, 2**20], 3 * 2**80, "bad_shape"),
        ([3, 0, 16, 16], 1, "bad_shape"),
        ([3, 1, 100_000, 100_000], 3 * 10**10, "bad_shape"),
        ([3, -1, 16, 16], 768, "bad_shape"),
        ([3, 2**63, 16, 16], 768, "bad_shape"),
        ([3, 2, 16], 96, "bad_shape"),
        ([3, 2, 16, 16, 1], 1536, "bad_shape"),
        ([3, 2, 16, 16], 2**70, "byte_size_mismatch"),
        ([3, 2, 16, 16], 0, "bad_byte_size"),
        ([3, 2, 16, 16], -1536, "bad_byte_size"),
    ],
)  # fmt: skip
def test_absurd_shapes_and_sizes(worker, segment, shape, byte_size, code):
    src = source(segment(), shape=shape, byte_size=byte_size)
    refused(worker, one(src), 400, code)


def test_offsets_past_the_segment(worker, segment):
    key = segment()
    refused(worker, one(source(key, offset=-1)), 400, "bad_offset")
    refused(worker, one(source(key, offset=2**62)), 400, "segment_too_small")
    refused(worker, one(source(key, offset=NBYTES)), 400, "segment_too_small")
