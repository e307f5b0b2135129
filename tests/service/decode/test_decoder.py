"""The reference decode in this process: byte-exact against plain ffmpeg, checks, the frames
object, the worker's cache. The worker's side of it is in tests/service/fdsocket/test_decodes.py."""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
from framewire.client import BadRequest, Client, MediaError, NotFound, Unavailable
from framewire.client.wire import DecodeRequest
from framewire.core.decode import SEALS, Decoded
from framewire.core.reference import decode_reference
from framewire.service._decode.decoder import DecodeCache, DecodeKey
from framewire.service._ops.metrics import Metrics

from tests.support.refclips import DECODE_CASES, case_id, make_clips, make_video, oracle, params


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_clips(tmp_path_factory.mktemp("clips"))


@pytest.fixture
def no_worker(tmp_path: Path) -> Path:
    return tmp_path / "no-worker.sock"


@pytest.mark.parametrize("case", DECODE_CASES, ids=case_id)
def test_local_fallback_is_byte_exact(clips, no_worker, case):
    kw = params(case)
    with decode_reference(clips[case["clip"]], fd_socket=no_worker, **kw) as ref:
        assert ref.source == "local" and not ref.cached
        assert ref.frames.shape == (len(ref), kw["height"], kw["width"], 3)
        assert ref.frames.dtype == np.uint8
        assert ref.frames.tobytes() == oracle(clips[case["clip"]], **kw)
        if "max_frames" in kw:
            assert len(ref) == kw["max_frames"]


def test_a_local_decode_reports_the_frames_it_wrote(clips):
    """``started`` gets the run while ffmpeg writes; once the memfd is handed over the run
    still answers (from the size it sealed), never from a descriptor it no longer owns."""
    from framewire.core.reference import decode_locally, make_request

    request = make_request(clips["c30.mp4"], fps=24, width=45, height=33)
    runs = []
    with decode_locally(request, started=runs.append) as ref:
        [run] = runs
        assert run.frames_written() == len(ref) == 48
        assert ref.frames.tobytes() == oracle(clips["c30.mp4"], fps=24, width=45, height=33)


def test_refused_connection_falls_back(clips, tmp_path):
    # A socket file nobody listens on: what a killed worker leaves behind.
    dead = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(dead))
        with (
            Client(fd_socket=dead) as c,
            c.decode_reference(clips["c30.mp4"], fps=10, width=16, height=16) as ref,
        ):
            assert ref.source == "local"
            assert ref.frames.tobytes() == oracle(clips["c30.mp4"], fps=10, width=16, height=16)
        with pytest.raises(Unavailable), Client(fd_socket=dead) as c:
            c.decode_reference(clips["c30.mp4"], fps=10, width=16, height=16, local_fallback=False)


def test_async_client_falls_back_too(clips, no_worker):
    async def go() -> bytes:
        from framewire.client import AsyncClient

        async with AsyncClient(fd_socket=no_worker) as c:
            with await c.decode_reference(clips["c25.mp4"], fps=5, width=8, height=6) as ref:
                return ref.frames.tobytes()

    assert asyncio.run(go()) == oracle(clips["c25.mp4"], fps=5, width=8, height=6)


@pytest.mark.parametrize(
    "bad",
    [
        {"fps": 0},
        {"fps": float("nan")},
        {"width": 0},
        {"height": 16385},
        {"start": -1.0},
        {"max_frames": 0},
    ],
)
def test_bad_parameters_are_refused_before_any_work(clips, no_worker, bad):
    kw = {"fps": 24, "width": 16, "height": 16} | bad
    with pytest.raises(BadRequest) as err:
        decode_reference(clips["c30.mp4"], fd_socket=no_worker, **kw)
    assert err.value.code == "bad_request"


def test_missing_and_non_video_files(tmp_path, no_worker):
    with pytest.raises(NotFound):
        decode_reference(tmp_path / "absent.mp4", fd_socket=no_worker, fps=24, width=8, height=8)
    text = tmp_path / "notes.mp4"
    text.write_text("not a video\n" * 100)
    with pytest.raises(MediaError) as err:
        decode_reference(text, fd_socket=no_worker, fps=24, width=8, height=8)
    assert err.value.code == "decode_failed"
    assert "Invalid data" in err.value.message and err.value.detail


def test_zero_frames_is_an_error(clips, no_worker):
    # Starting past the end: ffmpeg succeeds and writes nothing.
    with pytest.raises(MediaError, match="no frames"):
        decode_reference(clips["c30.mp4"], fd_socket=no_worker, fps=24, width=8, height=8, start=60)


def test_frames_object(clips, no_worker):
    ref = decode_reference(clips["c30.mp4"], fd_socket=no_worker, fps=6, width=20, height=10)
    original = ref.frames.copy()
    with pytest.raises(ValueError, match="read-only"):
        ref.frames[0, 0, 0, 0] = 1
    mine = ref.writable()
    mine[:] = 7  # private to this view
    tensor = ref.torch()
    tensor.zero_()
    assert np.array_equal(ref.frames, original)
    assert (mine == 7).all() and int(tensor.sum()) == 0
    assert tuple(tensor.shape) == ref.shape
    del mine, tensor
    ref.close()
    ref.close()
    assert ref.closed
    with pytest.raises(ValueError, match="closed"):
        _ = ref.frames
    with pytest.raises(ValueError, match="closed"):
        ref.writable()


def test_decode_bound_is_enforced_by_the_kernel_during_the_run(clips):
    from framewire.core.decode import DecodeRun
    from framewire.core.media.inputs import InputFile
    from framewire.core.media.process import find_ffmpeg

    video = InputFile.open(clips["c30.mp4"])  # 20 frames at 10 fps
    request = DecodeRequest(path=video.name, fps=10, width=40, height=30)
    bound = 10 * request.frame_bytes
    run = DecodeRun(find_ffmpeg(), video, request, max_bytes=bound)
    with pytest.raises(BadRequest) as err:
        run.wait()
    assert err.value.code == "decode_too_large" and "max_frames" in err.value.message
    # ffmpeg itself was stopped at the bound (SIGXFSZ), not its result refused afterwards.
    assert run.ff.proc.returncode == -signal.SIGXFSZ
    # Exactly at the bound is allowed, and byte-exact.
    fits = DecodeRequest(path=video.name, fps=10, width=40, height=30, max_frames=10)
    decoded = DecodeRun(find_ffmpeg(), video, fits, max_bytes=bound).wait()
    try:
        assert (decoded.frames, decoded.byte_size) == (10, bound)
        got = os.pread(decoded.fd, bound, 0)
        assert got == oracle(video.name, fps=10, width=40, height=30, max_frames=10)
    finally:
        os.close(decoded.fd)
    # One frame over the bound is refused before ffmpeg starts.
    with pytest.raises(BadRequest) as err:
        DecodeRun(find_ffmpeg(), video, request, max_bytes=request.frame_bytes - 1)
    assert err.value.code == "decode_too_large"
    video.close()


def test_local_memfd_is_sealed(clips, no_worker):
    with decode_reference(clips["c30.mp4"], fd_socket=no_worker, fps=6, width=20, height=10) as ref:
        assert fcntl.fcntl(ref._fd, fcntl.F_GET_SEALS) & SEALS == SEALS


def _memfd(size: int) -> Decoded:
    fd = os.memfd_create("framewire-test-cache", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return Decoded(fd, 1, size, 1.0)


def _key(n: int) -> DecodeKey:
    return DecodeKey(1, n, 100, 0, 24.0, 8, 8, 0.0, None)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_cache_evicts_least_recently_used_and_closes_it():
    metrics = Metrics()
    cache = DecodeCache(250, metrics)
    a, b, c = _memfd(100), _memfd(100), _memfd(100)
    assert cache.put(_key(1), a) and cache.put(_key(2), b)
    assert cache.get(_key(1)) is a  # now b is the oldest
    assert cache.put(_key(3), c)
    assert cache.get(_key(2)) is None and not _is_open(b.fd)
    assert _is_open(a.fd) and _is_open(c.fd)
    assert cache.bytes == 200 and len(cache) == 2
    too_big = _memfd(300)
    assert not cache.put(_key(4), too_big)  # the caller keeps (and closes) it
    os.close(too_big.fd)
    assert metrics.registry.get_sample_value("framewire_decode_cache_bytes") == 200
    cache.clear()
    assert not _is_open(a.fd) and not _is_open(c.fd) and cache.bytes == 0


def test_rewritten_file_gets_a_new_identity(tmp_path):
    from framewire.service._decode.decoder import file_identity

    path = make_video(tmp_path / "v.mp4", "testsrc2=size=32x32:rate=10", 0.5)
    first = file_identity(path)
    make_video(path, "testsrc2=size=48x32:rate=10", 0.5)
    assert file_identity(path) != first


# --- the worker's single flight, in process, with a stand-in ffmpeg of known timing -------

# Stands in for ffmpeg: waits, then writes FAKE_BYTES zero bytes to its last argument's
# pipe:FD; with FAKE_APPEND it first appends to its input, like a writer of that file.
# One process (no shell and sleep child), so a kill leaves nothing behind.
FAKE_FFMPEG = """#!{python} -S
import os, sys, time
if os.environ.get("FAKE_APPEND"):
    with open(sys.argv[sys.argv.index("-i") + 1], "ab") as f:
        f.write(b"x")
time.sleep(float(os.environ.get("FAKE_DELAY", "0.3")))
os.write(int(sys.argv[-1].removeprefix("pipe:")), bytes(int(os.environ.get("FAKE_BYTES", "12"))))
"""


@pytest.fixture
def slow_decoder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from framewire.core.media.binary import Binary
    from framewire.service._decode.decoder import ReferenceDecoder
    from framewire.service._settings import Settings

    fake = tmp_path / "fake-ffmpeg"
    fake.write_text(FAKE_FFMPEG.format(python=sys.executable))
    fake.chmod(0o755)
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    for name in ("a.mp4", "b.mp4"):
        (inputs / name).write_bytes(b"stands for a video")
    settings = Settings(input_roots=[str(inputs)], cpu_slots=1, max_queue=0)
    metrics = Metrics()
    binary = Binary(str(fake))
    decoder = ReferenceDecoder(settings, binary, metrics)
    yield decoder, inputs, monkeypatch
    asyncio.run(decoder.close())
    binary.close()


def _req(path: Path, **kw: object) -> DecodeRequest:
    return DecodeRequest(path=str(path), **{"fps": 24, "width": 2, "height": 2} | kw)  # type: ignore[arg-type]


def _count(decoder, name: str) -> float:  # type: ignore[no-untyped-def]
    return decoder.metrics.registry.get_sample_value(name) or 0.0


def test_single_flight_shares_one_run_and_its_answer(slow_decoder):
    decoder, inputs, _ = slow_decoder

    async def go() -> tuple[list, object]:
        answers = await asyncio.gather(*[decoder.decode(_req(inputs / "a.mp4")) for _ in range(5)])
        later = await decoder.decode(_req(inputs / "a.mp4"))
        return answers, later

    answers, later = asyncio.run(go())
    try:
        inodes = {os.fstat(a.fd).st_ino for a in [*answers, later]}
        assert len(inodes) == 1 and len({a.fd for a in answers}) == 5  # one memfd, own dups
        assert [a.cached for a in answers] == [False] * 5 and later.cached
        assert _count(decoder, "framewire_decodes_total") == 1
        assert _count(decoder, "framewire_decode_coalesced_total") == 4
        assert _count(decoder, "framewire_decode_cache_hits_total") == 1
    finally:
        for a in [*answers, later]:
            os.close(a.fd)


def test_failure_reaches_every_waiter_and_is_not_cached(slow_decoder):
    decoder, inputs, monkeypatch = slow_decoder
    monkeypatch.setenv("FAKE_BYTES", "0")

    async def go() -> list:
        return await asyncio.gather(
            *[decoder.decode(_req(inputs / "a.mp4")) for _ in range(4)], return_exceptions=True
        )

    errors = asyncio.run(go())
    assert all(isinstance(e, MediaError) and e.code == "decode_failed" for e in errors)
    assert len({str(e) for e in errors}) == 1
    assert _count(decoder, "framewire_decodes_total") == 1
    assert isinstance(asyncio.run(go())[0], MediaError)
    assert _count(decoder, "framewire_decodes_total") == 2  # tried again, not cached
    assert _count(decoder, "framewire_decode_failures_total") == 2


def test_a_file_written_during_every_decode_is_refused(slow_decoder):
    decoder, inputs, monkeypatch = slow_decoder
    monkeypatch.setenv("FAKE_APPEND", "1")
    with pytest.raises(MediaError) as err:
        asyncio.run(decoder.decode(_req(inputs / "a.mp4")))
    assert err.value.code == "input_changed"
    assert _count(decoder, "framewire_decodes_total") == 2  # decoded again once, then refused
    assert len(decoder.cache) == 0


def test_distinct_decodes_past_the_queue_are_overloaded(slow_decoder):
    from framewire.client import Overloaded

    decoder, inputs, _ = slow_decoder  # one slot, no queue

    async def go() -> list:
        first = asyncio.create_task(decoder.decode(_req(inputs / "a.mp4")))
        await asyncio.sleep(0.05)
        second = await asyncio.gather(
            decoder.decode(_req(inputs / "b.mp4")), return_exceptions=True
        )
        return [await first, *second]

    ok, refused = asyncio.run(go())
    os.close(ok.fd)
    assert isinstance(refused, Overloaded) and refused.code == "overloaded"


def test_cancelled_waiter_and_shutdown_leave_nothing(slow_decoder):
    decoder, inputs, monkeypatch = slow_decoder

    async def go() -> BaseException | None:
        gone = asyncio.create_task(decoder.decode(_req(inputs / "a.mp4")))
        await asyncio.sleep(0.05)
        gone.cancel()  # its caller hung up; the decode goes on for the cache
        answer = await decoder.decode(_req(inputs / "a.mp4"))
        os.close(answer.fd)
        monkeypatch.setenv("FAKE_DELAY", "30")
        stuck = asyncio.create_task(decoder.decode(_req(inputs / "b.mp4")))
        await asyncio.sleep(0.2)
        await asyncio.wait_for(decoder.close(), 10)  # kills the 30 s ffmpeg
        return (await asyncio.gather(stuck, return_exceptions=True))[0]  # type: ignore[return-value]

    err = asyncio.run(go())
    assert isinstance(err, MediaError) and "killed" in err.message
    assert len(decoder.cache) == 0  # close() dropped the cache (and closed its memfds)


@pytest.mark.parametrize("xdg", [None, "/run/user/4321"])
def test_client_finds_the_workers_default_fd_socket(monkeypatch, xdg):
    from framewire.core.fdsocket import default_fd_socket
    from framewire.service._settings import Settings

    monkeypatch.delenv("FRAMEWIRE_FD_SOCKET", raising=False)
    if xdg is None:
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    else:
        monkeypatch.setenv("XDG_RUNTIME_DIR", xdg)
    assert default_fd_socket() == Settings().fd_socket
    monkeypatch.setenv("FRAMEWIRE_FD_SOCKET", "/srv/fw/fd.sock")
    assert default_fd_socket() == Settings().fd_socket == Path("/srv/fw/fd.sock")
