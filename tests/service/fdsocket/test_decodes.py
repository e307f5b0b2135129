"""The fd socket of a real worker: bytes, single flight, sharing, errors, protocol, access."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import stat
import threading
from pathlib import Path

import numpy as np
import pytest
from framewire.client import AsyncClient, BadRequest, Client, Forbidden, MediaError, NotFound
from framewire.client.wire import DecodeRequest
from framewire.core.decode import SEALS

from tests.support.cli import run_cli
from tests.support.decode_client import decode_ranks
from tests.support.refclips import (
    DECODE_CASES,
    RawConnection,
    case_id,
    close_all,
    make_clips,
    make_video,
    oracle,
    params,
)
from tests.support.worker import Worker, metric


@pytest.fixture(scope="module", autouse=True)
def clips(worker: Worker) -> dict[str, Path]:
    """The reference videos, in the module's worker's input root."""
    return make_clips(worker.inputs)


@pytest.fixture
def fd_sock(worker: Worker) -> Path:
    return worker.uds.parent / "fd.sock"


def decode_msg(path: Path, **kw: object) -> dict[str, object]:
    return DecodeRequest(path=str(path), **kw).model_dump(mode="json")  # type: ignore[arg-type]


@pytest.mark.parametrize("case", DECODE_CASES, ids=case_id)
def test_worker_decode_is_byte_exact_and_cached(worker, fd_sock, case):
    video, kw = worker.inputs / case["clip"], params(case)
    expected = oracle(video, **kw)
    with Client(fd_socket=fd_sock, timeout=60) as c:
        with c.decode_reference(video, local_fallback=False, **kw) as first:
            assert first.source == "worker"
            assert first.frames.tobytes() == expected
        with c.decode_reference(video, local_fallback=False, **kw) as again:
            assert again.cached and again.frames.tobytes() == expected


def test_reply_header_and_sealed_fd(worker, fd_sock):
    video = worker.inputs / "c30.mp4"
    with RawConnection(fd_sock) as conn:
        header, fds = conn.call(decode_msg(video, fps=10, width=40, height=30))
        try:
            assert len(fds) == 1
            assert header["ok"] is True
            assert (header["frames"], header["height"], header["width"]) == (20, 30, 40)
            assert header["byte_size"] == 20 * 30 * 40 * 3 == os.fstat(fds[0]).st_size
            assert set(header) == {
                "ok", "frames", "height", "width", "byte_size", "cached", "decode_ms"
            }  # fmt: skip
            assert fcntl.fcntl(fds[0], fcntl.F_GET_SEALS) & SEALS == SEALS
            with pytest.raises(PermissionError):
                os.pwrite(fds[0], b"x", 0)
        finally:
            close_all(fds)


def test_protocol_robustness(worker, fd_sock):
    with RawConnection(fd_sock) as conn:
        assert conn.call({"op": "ping"})[0]["ok"] is True
        for bad in (b"{not json\n", b"[1, 2]\n", b'{"op": "launch"}\n', b"\xff\xfe\n"):
            header, fds = conn.call(bad)
            assert (header["ok"], header["code"], fds) == (False, "bad_request", []), bad
        # An oversize line is refused once, and the connection goes on with the next one.
        header, fds = conn.call(b'{"op": "ping", "pad": "' + b"x" * (200 << 10) + b'"}\n')
        assert (header["code"], fds) == ("bad_request", [])
        assert "bytes" in header["message"]
        assert conn.call({"op": "ping"})[0]["ok"] is True
        # Several requests in one write are answered in order.
        conn.send(b'{"op":"ping"}\n{"op":"decode"}\n{"op":"ping"}\n')
        assert [conn.reply()[0].get("code") for _ in range(3)] == [None, "bad_request", None]


@pytest.mark.parametrize(
    "bad",
    [{"fps": 0}, {"fps": -1}, {"width": 0}, {"height": 20000}, {"start": -0.5},
     {"max_frames": 0}, {"width": 1.5}, {"extra": 1}],
)  # fmt: skip
def test_invalid_parameters_are_bad_requests(worker, fd_sock, bad):
    message = {"op": "decode", "path": str(worker.inputs / "c30.mp4"), "fps": 24}
    message |= {"width": 16, "height": 16} | bad
    with RawConnection(fd_sock) as conn:
        header, fds = conn.call(message)
    assert (header["ok"], header["code"], fds) == (False, "bad_request", [])


def test_paths_outside_roots_and_missing_files(worker, fd_sock, tmp_path):
    outside = make_video(tmp_path / "outside.mp4", "testsrc2=size=16x16:rate=5", 0.4)
    link = worker.inputs / "link-out.mp4"
    link.symlink_to(outside)
    try:
        with Client(fd_socket=fd_sock, timeout=60) as c:
            for path in (outside, link, f"{worker.inputs}/../x.mp4"):
                with pytest.raises(Forbidden) as err:
                    c.decode_reference(path, fps=5, width=8, height=8)
                assert err.value.code == "path_outside_roots", (path, err.value.code)
            with pytest.raises(NotFound) as missing:
                c.decode_reference(worker.inputs / "nope.mp4", fps=5, width=8, height=8)
            assert missing.value.code == "not_found"
    finally:
        link.unlink()


def test_corrupt_file_fails_every_waiter_and_worker_keeps_serving(worker, fd_sock):
    bad = worker.inputs / "corrupt.mp4"
    good = (worker.inputs / "c30.mp4").read_bytes()
    bad.write_bytes(good[: len(good) // 3])  # truncated: no index to decode from
    errors: list[BaseException] = []

    def ask() -> None:
        with Client(fd_socket=fd_sock, timeout=60) as c:
            try:
                c.decode_reference(bad, fps=24, width=32, height=32)
            except BaseException as exc:
                errors.append(exc)

    threads = [threading.Thread(target=ask, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(errors) == 8
    for exc in errors:
        assert isinstance(exc, MediaError) and exc.code == "decode_failed"
        assert "moov atom not found" in (exc.detail or ""), exc
        assert "ffmpeg exited" in exc.message
    with worker.http() as h:
        assert metric(h, "framewire_decode_failures_total") >= 1
    # Failures are not cached: the same key is decoded again once the file is whole.
    bad.write_bytes(good)
    with (
        Client(fd_socket=fd_sock, timeout=60) as c,
        c.decode_reference(bad, fps=24, width=32, height=32) as r,
    ):
        assert not r.cached and r.frames.tobytes() == oracle(bad, fps=24, width=32, height=32)


def test_rewritten_file_is_decoded_again(worker, fd_sock):
    video = worker.inputs / "rewritten.mp4"
    kw = {"fps": 10, "width": 24, "height": 16}
    make_video(video, "testsrc2=size=64x48:rate=10", 1.0)
    with worker.http() as h, Client(fd_socket=fd_sock, timeout=60) as c:
        with c.decode_reference(video, **kw) as r:
            first = r.frames.tobytes()
        before = metric(h, "framewire_decodes_total")
        make_video(video, "mandelbrot=size=64x48:rate=10", 1.0)
        with c.decode_reference(video, **kw) as r:
            assert not r.cached
            second = r.frames.tobytes()
        assert metric(h, "framewire_decodes_total") == before + 1
    assert second != first and second == oracle(video, **kw)


def test_eight_processes_share_one_decode(worker, fd_sock):
    video = worker.inputs / "shared8.mp4"
    make_video(video, "testsrc2=size=97x61:rate=30", 2.0)
    kw = {"fps": 30, "width": 256, "height": 144}
    expected_size = 60 * 144 * 256 * 3
    counters = ("framewire_decodes_total", "framewire_decode_cache_hits_total",
                "framewire_decode_coalesced_total")  # fmt: skip
    with worker.http() as h:
        before = [metric(h, name) for name in counters]
        with decode_ranks(8, fd_sock, video, **kw) as ranks:
            ranks.tell("go")  # all released at once
            answers = ranks.hear()
            ranks.tell("measure")
            pss = [answer["pss_kib"] * 1024 for answer in ranks.hear()]
            ranks.tell("exit")
        runs, hits, joined = (metric(h, n) - b for n, b in zip(counters, before, strict=True))
    assert runs == 1, "exactly one ffmpeg run"
    assert hits + joined == 7 and sum(a["cached"] for a in answers) == hits
    assert {a["sha256"] for a in answers} == {hashlib.sha256(oracle(video, **kw)).hexdigest()}
    assert {a["nbytes"] for a in answers} == {expected_size}
    assert {a["source"] for a in answers} == {"worker"}
    # Every process read every byte, yet together they hold about one copy.
    assert 0.9 * expected_size <= sum(pss) <= 1.2 * expected_size, pss
    assert max(pss) <= 0.5 * expected_size, pss
    print(f"pss per process {pss}, {hits:.0f} cache hits, {joined:.0f} joined the running decode")


def test_async_client_and_many_requests_per_connection(worker, fd_sock):
    video = worker.inputs / "c25.mp4"

    async def go() -> list[bytes]:
        async with AsyncClient(fd_socket=fd_sock, timeout=60) as c:
            refs = await asyncio.gather(
                *[c.decode_reference(video, fps=8, width=10, height=6) for _ in range(4)]
            )
        out = [r.frames.tobytes() for r in refs]
        for r in refs:
            r.close()
        return out

    assert set(asyncio.run(go())) == {oracle(video, fps=8, width=10, height=6)}
    with RawConnection(fd_sock) as conn:
        for _ in range(5):
            header, fds = conn.call(decode_msg(video, fps=8, width=10, height=6))
            close_all(fds)
            assert header["ok"] and header["cached"] and len(fds) == 1


def test_cli_decode_through_the_worker(worker, fd_sock, tmp_path):
    out = tmp_path / "frames.npy"
    video = worker.inputs / "c30.mp4"
    run = run_cli("decode", str(video), "--fps", "15", "--size", "21x13", "--start", "0.2",
                  "--max-frames", "9", "-o", str(out), "--fd-socket", str(fd_sock),
                  "--no-fallback", timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "from worker" in run.stdout and "9 frames of 21x13" in run.stdout
    frames = np.load(out)
    assert frames.shape == (9, 13, 21, 3)
    expected = oracle(video, fps=15, width=21, height=13, start=0.2, max_frames=9)
    assert frames.tobytes() == expected


def test_socket_mode_and_info(worker, fd_sock):
    assert stat.S_IMODE(os.stat(fd_sock).st_mode) == 0o660
    with Client(worker.uds_url) as c:
        assert c.info()["sockets"]["fd_socket"] == str(fd_sock)


def test_zz_worker_holds_only_its_cache(worker):
    """After everything above: no memfd or ffmpeg left in the worker beyond the cache."""
    with worker.http() as h:
        entries = metric(h, "framewire_decode_cache_entries")
    decodes = [f for f in worker.open_fds() if f.startswith("/memfd:framewire-decode")]
    assert len(decodes) == entries > 0
    assert not [f for f in worker.open_fds() if "ffmpeg-stderr" in f]
    assert worker.children() == set()


def test_uid_not_allowed_is_forbidden(workers):
    w = workers.start("--allowed-uids", "12345")
    make_video(w.inputs / "v.mp4", "testsrc2=size=16x16:rate=5", 0.4)
    # Refused is an answer, not an unreachable worker: no local fallback.
    with (
        Client(fd_socket=w.fd_socket, timeout=60) as c,
        pytest.raises(Forbidden) as err,
    ):
        c.decode_reference(w.inputs / "v.mp4", fps=5, width=8, height=8)
    assert err.value.code == "forbidden"
    with RawConnection(w.fd_socket) as conn:
        assert conn.call({"op": "ping"})[0]["code"] == "forbidden"


def test_decodes_past_the_bound_are_refused_and_leave_nothing(workers):
    frame = 40 * 30 * 3
    w = workers.start("--max-decode-bytes", str(10 * frame))
    make_clips(w.inputs)
    video = w.inputs / "c30.mp4"  # 20 frames at 10 fps
    with Client(fd_socket=w.fd_socket, timeout=60) as c:
        # An answer of the worker, not an unreachable one: no local decode either.
        with pytest.raises(BadRequest) as err:
            c.decode_reference(video, fps=10, width=40, height=30)
        assert err.value.code == "decode_too_large"
        assert "FRAMEWIRE_MAX_DECODE_BYTES" in err.value.message
        with c.decode_reference(video, fps=10, width=40, height=30, max_frames=10) as ref:
            assert ref.source == "worker" and len(ref) == 10
            assert ref.frames.tobytes() == oracle(video, fps=10, width=40, height=30, max_frames=10)
    with w.http() as h:
        assert metric(h, "framewire_decodes_total") == 2
        assert metric(h, "framewire_decode_failures_total") == 1
        assert h.get("/v1/info").json()["limits"]["max_decode_bytes"] == 10 * frame
    assert w.children() == set()
    assert not [f for f in w.open_fds() if "ffmpeg-stderr" in f]
