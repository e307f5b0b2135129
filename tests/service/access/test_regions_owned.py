"""Regions belong to whoever registered them: what another local user can and cannot do with a
rank's regions, and with the registry's slots, against a real worker.

The rank is this process (root, an admin of the worker); the neighbours are forked
children that drop to uid 65534 or 65533 and speak HTTP over loopback TCP, where the
worker knows their uid from the kernel's socket table.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from framewire.client import Client
from framewire.client._sharing.fd import FdRegions
from framewire.core.errors import MediaError, Unavailable

from tests.service.fdsocket.test_regions import memfd, region_source, register
from tests.support.http import http_client
from tests.support.identity import NOBODY, as_user
from tests.support.media import make_clip, reference_mp4, sha256
from tests.support.refclips import RawConnection
from tests.support.requests import encode_body
from tests.support.segments import raw_bytes, shm_source
from tests.support.worker import Worker, Workers

OTHER = 65533  # a second neighbour, neither the registrant nor an admin


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    """A worker whose output root anyone may write: only the region may stop a neighbour."""
    base = Path(tempfile.mkdtemp(prefix="framewire-owned-"))
    base.chmod(0o755)
    started = Workers(lambda: base)
    # The status test holds 600 regions at once.
    w = started.start(env={**os.environ, "FRAMEWIRE_MAX_REGIONS_PER_OWNER": "1024"})
    w.outputs.chmod(0o777)
    try:
        yield w
    finally:
        started.stop_all()
        shutil.rmtree(base)


def refused_for_the_region(answer: tuple[int, Any], name: str) -> bool:
    status, body = answer
    return (status, body["code"]) == (403, "caller_not_permitted") and (
        f"region '{name}' belongs to" in body["error"]
    )


def http_call(url: str, method: str, path: str, body: dict | None = None) -> tuple[int, Any]:
    with http_client(url, timeout=60) as client:
        r = client.request(method, path, json=body)
        return r.status_code, r.json() if r.content else None


def neighbour(uid: int, url: str, method: str, path: str, body: dict | None = None) -> Any:
    return as_user(uid, http_call, url, method, path, body)


def own_segment(data: bytes, uid: int) -> str:
    """A segment ``uid`` owns and only it may read."""
    key = f"/framewire-test-{secrets.token_hex(6)}"
    path = Path(f"/dev/shm{key}")
    path.write_bytes(data)
    os.chown(path, uid, uid)
    path.chmod(0o600)
    return key


def names(worker, uid: int | None = None) -> list[str]:
    if uid is None:
        with worker.http() as h:
            return sorted(r["name"] for r in h.get("/v2/systemsharedmemory/status").json())
    status, body = neighbour(uid, worker.tcp_url, "GET", "/v2/systemsharedmemory/status")
    assert status == 200, body
    return sorted(r["name"] for r in body)


def test_another_user_cannot_see_free_or_take_a_ranks_region(worker, tmp_path):
    """The hijack: list the rank's fd region, unregister it over HTTP, register a segment of
    one's own under its name, so that the rank's next encode reads foreign frames."""
    clip = make_clip(frames=3, height=16, width=16)
    theirs = make_clip(frames=3, height=16, width=16, seed=7)
    data = raw_bytes(clip)
    url = worker.tcp_url
    key = own_segment(raw_bytes(theirs), NOBODY)
    try:
        with RawConnection(worker.fd_socket) as rank:
            fd = memfd(data)
            assert register(rank, "rank0", fd, len(data))["ok"]
            os.close(fd)
            assert names(worker) == ["rank0"]
            assert names(worker, NOBODY) == []  # not listed to another user
            one = "/v2/systemsharedmemory/region/rank0/status"
            assert neighbour(NOBODY, url, "GET", one)[0] == 404
            status, body = neighbour(
                NOBODY, url, "POST", "/v2/systemsharedmemory/region/rank0/unregister"
            )
            assert (status, body["code"]) == (403, "caller_not_permitted")
            assert neighbour(NOBODY, url, "POST", "/v2/systemsharedmemory/unregister")[0] == 200
            # Not even its own uid frees it over HTTP: the name is the connection's.
            with worker.http() as h:
                r = h.post("/v2/systemsharedmemory/region/rank0/unregister")
                assert (r.status_code, r.json()["code"]) == (403, "caller_not_permitted")
                assert h.post("/v2/systemsharedmemory/unregister").status_code == 200
            assert names(worker) == ["rank0"]
            claim = {"key": key, "offset": 0, "byte_size": len(data)}
            status, body = neighbour(
                NOBODY, url, "POST", "/v2/systemsharedmemory/region/rank0/register", claim
            )
            assert (status, body["code"]) == (400, "region_exists")
            # The rank's encode reads the rank's frames.
            with worker.http() as h:
                r = h.post("/v1/videos:encode",
                           json=encode_body(region_source("rank0", clip), "rank0.mp4"))  # fmt: skip
            assert r.status_code == 200, r.text
            assert r.json()["outputs"][0]["sha256"] == reference_mp4(clip, tmp_path / "ref.mp4")
            # Nor may the neighbour encode from it, nor learn its size by overreaching.
            for offset in (0, 1 << 20):
                body = encode_body(region_source("rank0", clip, offset=offset), "n.mp4")
                answer = neighbour(NOBODY, url, "POST", "/v1/videos:encode", body)
                assert refused_for_the_region(answer, "rank0"), answer
    finally:
        Path(f"/dev/shm{key}").unlink()
        (worker.outputs / "rank0.mp4").unlink(missing_ok=True)
    assert names(worker) == []


def test_an_http_region_is_its_registrants_alone(worker, tmp_path):
    """A neighbour's own region: it sees, uses and frees it; a third user does none of that;
    the worker's uid (root here), an admin, sees it and may free it."""
    clip = make_clip(frames=2, height=16, width=16)
    data = raw_bytes(clip)
    key = own_segment(data, NOBODY)
    os.chmod(f"/dev/shm{key}", 0o644)  # readable by all: ownership alone must stop OTHER
    url, base = worker.tcp_url, "/v2/systemsharedmemory"
    try:
        claim = {"key": key, "offset": 0, "byte_size": len(data)}
        assert neighbour(NOBODY, url, "POST", f"{base}/region/mine/register", claim)[0] == 200
        assert names(worker, NOBODY) == ["mine"] and names(worker) == ["mine"]
        assert names(worker, OTHER) == []
        assert neighbour(OTHER, url, "GET", f"{base}/region/mine/status")[0] == 404
        body = encode_body(region_source("mine", clip), "other.mp4")
        answer = neighbour(OTHER, url, "POST", "/v1/videos:encode", body)
        assert refused_for_the_region(answer, "mine"), answer
        assert not (worker.outputs / "other.mp4").exists()
        # Its registrant encodes from it.
        status, answer = neighbour(NOBODY, url, "POST", "/v1/videos:encode", body)
        assert status == 200, answer
        assert answer["outputs"][0]["sha256"] == reference_mp4(clip, tmp_path / "ref.mp4")
        (worker.outputs / "other.mp4").unlink()
        status, answer = neighbour(OTHER, url, "POST", f"{base}/region/mine/unregister")
        assert (status, answer["code"]) == (403, "caller_not_permitted")
        assert neighbour(OTHER, url, "POST", f"{base}/unregister")[0] == 200  # frees nothing
        assert names(worker) == ["mine"]
        assert neighbour(NOBODY, url, "POST", f"{base}/region/mine/unregister")[0] == 200
        assert names(worker) == []
        # Registered again; the admin frees every HTTP region at once.
        assert neighbour(NOBODY, url, "POST", f"{base}/region/mine/register", claim)[0] == 200
        with worker.http() as h:
            assert h.post(f"{base}/unregister").status_code == 200
        assert names(worker) == []
    finally:
        Path(f"/dev/shm{key}").unlink()


@pytest.mark.parametrize("name", ["a\nb", "nul\0", "x" * 129, "-lead", "a b", "é"])
def test_http_region_names_follow_the_fd_sockets_rule(worker, segments, name):
    clip = make_clip(frames=2, height=16, width=16)
    key = segments.write(clip)
    path = f"/v2/systemsharedmemory/region/{quote(name, safe='')}/register"
    with worker.http() as h:
        r = h.post(path, json={"key": key, "offset": 0, "byte_size": len(raw_bytes(clip))})
        assert (r.status_code, r.json()["code"]) == (400, "bad_region_name"), r.text
    with RawConnection(worker.fd_socket) as conn:
        fd = memfd(raw_bytes(clip))
        assert register(conn, name, fd, len(raw_bytes(clip)))["code"] == "bad_request"
        os.close(fd)
    assert names(worker) == []


def test_status_while_regions_come_and_go():
    """The status route reads the registry on a request thread while registrations on other
    threads (and the event loop) change it. Threads switch every 0.1 ms here, so an
    unguarded read meets a change about once in a dozen tries (once in 3000 requests to a
    worker)."""
    from framewire.service._sources.regions import RegionRegistry

    registry = RegionRegistry([], max_regions=2000)
    registry.max_per_owner = 2000
    for i in range(1000):
        registry.register_fd(f"r{i}", memfd(b"\0" * 64), 0, 64, owner=0)
    stop = threading.Event()
    failures: list[BaseException] = []

    def churn(tag: str) -> None:
        while not stop.is_set():
            registry.drop(registry.register_fd(tag, memfd(b"\0" * 64), 0, 64, owner=0))

    def look() -> None:
        try:
            for _ in range(2000):
                assert len(registry.status()) >= 1000
        except BaseException as exc:
            failures.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        threads = [threading.Thread(target=churn, args=(f"c{i}",)) for i in range(4)]
        for t in threads:
            t.start()
        look()
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        for t in threads:
            t.join(30)
        registry.close()
    assert failures == []


def test_one_user_cannot_take_every_region_slot(workers, tmp_path):
    """Past its quota a user's registrations are refused; the rank's still go through, and a
    client refused on the fd handover for room hands its frames over as a segment instead."""
    w = workers.start("--max-regions", "6", "--max-regions-per-owner", "2")
    clip = make_clip(frames=2, height=16, width=16)
    data = raw_bytes(clip)
    key = own_segment(data, NOBODY)
    base = "/v2/systemsharedmemory"
    try:
        claim = {"key": key, "offset": 0, "byte_size": len(data)}
        for name in ("s1", "s2"):
            assert (
                neighbour(NOBODY, w.tcp_url, "POST", f"{base}/region/{name}/register", claim)[0]
                == 200
            )
        status, body = neighbour(NOBODY, w.tcp_url, "POST", f"{base}/region/s3/register", claim)
        assert (status, body["code"]) == (503, "region_quota")
        with RawConnection(w.fd_socket) as rank:
            for name in ("f1", "f2"):
                fd = memfd(data)
                assert register(rank, name, fd, len(data))["ok"]
                os.close(fd)
            # The rank's own quota is spent too: the client's class says so.
            regions = FdRegions(w.fd_socket, 30)
            fd = memfd(data)
            try:
                with pytest.raises(Unavailable) as err:
                    regions.register(fd, 0, len(data))
                assert not isinstance(err.value, MediaError)
                assert err.value.code == "region_quota"
            finally:
                os.close(fd)
                regions.close()
            with Client(w.uds_url, fd_socket=w.fd_socket) as c:
                result = c.save_video(clip, "fallback.mp4", fps=24)
                assert c.host_route == "fd"  # still connected; this call went as a segment
                with c.open_video("streamed.mp4", fps=24) as writer:  # staging likewise
                    writer.write(clip[:, :1])
                    writer.write(clip[:, 1:])
            want = reference_mp4(clip, tmp_path / "ref.mp4")
            assert result.sha256 == want == sha256(w.outputs / "fallback.mp4")
            assert writer.result is not None and writer.result.sha256 == want
    finally:
        Path(f"/dev/shm{key}").unlink()


def test_a_stream_session_is_its_openers_alone(worker, tmp_path):
    """Another user who learns a session's id can neither feed it frames, nor finish, abort
    or look at it: to that user the session does not exist."""
    clip = make_clip(frames=4, height=16, width=16)
    head, tail = clip[:, :2].contiguous(), clip[:, 2:].contiguous()
    keys = [own_segment(raw_bytes(head), 0), own_segment(raw_bytes(tail), 0)]
    keys.append(own_segment(raw_bytes(tail), NOBODY))
    os.chmod(f"/dev/shm{keys[2]}", 0o644)
    url = worker.tcp_url
    try:
        with worker.http() as h:
            opened = h.post("/v1/streams", json={"path": "owned.mp4", "fps": 24, "height": 16,
                                                 "width": 16, "dtype": "float32"})  # fmt: skip
            assert opened.status_code == 201, opened.text
            sid = opened.json()["id"]
            chunk = {"first_frame": 0, "source": shm_source(keys[0], head)}
            assert h.post(f"/v1/streams/{sid}/frames", json=chunk).status_code == 200
            foreign = {"first_frame": 2, "source": shm_source(keys[2], tail)}
            for method, path, body in (
                ("POST", f"/v1/streams/{sid}/frames", foreign),
                ("GET", f"/v1/streams/{sid}", None),
                ("POST", f"/v1/streams/{sid}/finish", None),
                ("DELETE", f"/v1/streams/{sid}", None),
            ):
                status, answer = neighbour(NOBODY, url, method, path, body)
                assert (status, (answer or {}).get("code")) == (404, "stream_not_found"), (
                    method, path, status, answer
                )  # fmt: skip
            chunk = {"first_frame": 2, "source": shm_source(keys[1], tail)}
            assert h.post(f"/v1/streams/{sid}/frames", json=chunk).status_code == 200
            done = h.post(f"/v1/streams/{sid}/finish")
            assert done.status_code == 200, done.text
        assert done.json()["sha256"] == reference_mp4(clip, tmp_path / "ref.mp4")
    finally:
        for key in keys:
            Path(f"/dev/shm{key}").unlink()
        (worker.outputs / "owned.mp4").unlink(missing_ok=True)
