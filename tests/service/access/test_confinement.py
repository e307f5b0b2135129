"""What a hostile local caller can make the worker (and its ffmpeg) read, write or sweep.

Each test is one class of escape, tried against a real worker: files that name
other files (playlists, concat lists), inputs that are not regular files, output
names the worker reserves or formats that write more than one file, callers who
ask the worker to read what they may not, and the routes the token guards.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from framewire.core.media.argv import AUDIO_FILE_GUARD, decode_argv
from framewire.core.wire import DecodeRequest

from tests.support.identity import NOBODY, as_nobody, open_worker, post_json
from tests.support.media import FFMPEG, make_clip, reference_mp4, sha256
from tests.support.real import needs_root
from tests.support.refclips import RawConnection, make_video, oracle
from tests.support.requests import encode_body
from tests.support.segments import raw_bytes, shm_source
from tests.support.worker import Worker

SECRET = b"framewire-secret-bytes"


@pytest.fixture(scope="module")
def world() -> Iterator[dict[str, Path]]:
    """A worker whose sockets and roots other users can reach, and a secret outside them."""
    with open_worker() as w:
        base = w.outputs.parent
        outside = base / "outside"
        outside.mkdir()
        make_video(outside / "secret.mp4", "testsrc2=size=64x48:rate=24", 1.0)
        (outside / "secret.wav").write_bytes(SECRET)
        yield {"base": base, "outside": outside, "worker": w}  # type: ignore[dict-item]


@pytest.fixture
def worker(world) -> Worker:
    return world["worker"]


def decode(worker: Worker, path: Path | str, **kw: object) -> dict[str, object]:
    msg = {"op": "decode", "path": str(path), "fps": 24, "width": 64, "height": 48} | kw
    with RawConnection(worker.uds.parent / "fd.sock") as conn:
        reply, fds = conn.call(msg)
    for fd in fds:
        os.close(fd)
    assert not (reply["ok"] and fds == []), reply
    return reply


# --- inputs that name other files -------------------------------------------------------


def referring_files(inputs: Path, outside: Path) -> dict[str, Path]:
    """Files under the input roots whose content leads ffmpeg to the secret outside them."""
    secret = outside / "secret.mp4"

    def playlist(entry: str) -> str:
        return f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:1,\n{entry}\n#EXT-X-ENDLIST\n"

    files = {
        "m3u8-absolute.m3u8": playlist(str(secret)),
        "m3u8-file-url.m3u8": playlist(f"file:{secret}"),
        "m3u8-dotdot.m3u8": playlist("../outside/secret.mp4"),
        "list.ffconcat": f"ffconcat version 1.0\nfile '{secret}'\n",
        "meta.txt": ";FFMETADATA1\ntitle=x\n",
    }
    made = {}
    for name, text in files.items():
        made[name] = inputs / name
        made[name].write_text(text)
    return made


def test_files_that_name_other_files_are_not_followed(world):
    w, outside = world["worker"], world["outside"]
    files = referring_files(w.inputs, outside)
    # What the hole looks like: ffmpeg unguarded decodes the secret through a playlist.
    for name in ("m3u8-absolute.m3u8", "m3u8-file-url.m3u8", "m3u8-dotdot.m3u8"):
        request = DecodeRequest(path=str(files[name]), fps=24, width=64, height=48)
        argv = decode_argv(FFMPEG, request, guard=False)
        leaked = subprocess.run(argv, capture_output=True, timeout=60).stdout
        assert leaked == oracle(outside / "secret.mp4", fps=24, width=64, height=48), name
    for name, path in files.items():
        reply = decode(w, path)
        # Refused by the demuxer whitelist, or not even taken for a playlist (ffmpeg reads
        # it by an fd path with no extension): either way nothing is decoded.
        assert reply["ok"] is False, f"{name}: decoded through a reference: {reply}"
        assert reply["code"] in ("bad_request", "decode_failed"), (name, reply)
        with w.http() as h:
            r = h.post("/v1/probe", json={"paths": [str(path)]})
            assert r.status_code == 422 and r.json()["code"] == "not_video", (name, r.text)
            clip = make_clip(frames=2, height=16, width=16)
            key = f"/framewire-test-{secrets.token_hex(6)}"
            Path(f"/dev/shm{key}").write_bytes(raw_bytes(clip))
            try:
                body = encode_body(shm_source(key, clip), f"{name}.mp4", audio=str(path))
                r = h.post("/v1/videos:encode", json=body)
            finally:
                Path(f"/dev/shm{key}").unlink()
            refusal = (r.status_code, r.json()["code"])
            assert refusal in ((400, "input_format_refused"), (422, "ffmpeg_failed")), r.text
        assert not (w.outputs / f"{name}.mp4").exists()
    # The secret itself is refused by path, as before.
    assert decode(w, outside / "secret.mp4")["code"] == "forbidden"


def test_the_whitelists_refuse_what_ffmpeg_would_follow(world):
    """Each guard on its own, with the playlist named as ffmpeg likes it (.m3u8): some
    ffmpeg builds detect playlists whatever the name, and FRAMEWIRE_FFMPEG may be one."""
    import av
    from framewire.service._probe import GUARD

    w, outside = world["worker"], world["outside"]
    playlist = referring_files(w.inputs, outside)["m3u8-absolute.m3u8"]
    request = DecodeRequest(path=str(playlist), fps=24, width=64, height=48)
    open_door = subprocess.run(decode_argv(FFMPEG, request, guard=False), capture_output=True)
    assert open_door.returncode == 0 and open_door.stdout  # the hole, unguarded
    guarded = subprocess.run(decode_argv(FFMPEG, request), capture_output=True, text=True)
    assert guarded.returncode != 0 and "not on whitelist" in guarded.stderr
    audio = subprocess.run(
        [FFMPEG, "-v", "error", *AUDIO_FILE_GUARD, "-i", str(playlist), "-f", "null", "-"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert audio.returncode != 0 and "not on whitelist" in audio.stderr
    with av.open(str(playlist)) as container:  # PyAV unguarded: follows it too
        assert container.format.name == "hls"
    with pytest.raises(av.FFmpegError):
        av.open(str(playlist), container_options=GUARD)


def test_an_input_swapped_for_a_link_after_its_check_is_judged_by_what_opened(world, monkeypatch):
    """The opened file, not the path as judged, must lie under the roots."""
    from framewire.core.errors import Forbidden
    from framewire.service._access import paths

    w = world["worker"]
    real_open = paths.InputFile.open
    inside = w.inputs / "swap.mp4"
    make_video(inside, "testsrc2=size=64x48:rate=24", 0.5)

    def swap_then_open(path):  # between the judgement and the open
        inside.unlink()
        inside.symlink_to(world["outside"] / "secret.mp4")
        return real_open(path)

    monkeypatch.setattr(paths.InputFile, "open", staticmethod(swap_then_open))
    try:
        # open() follows the new link to a regular file: only judging the opened fd stops it.
        with pytest.raises(Forbidden) as err:
            paths.open_input("swap.mp4", [str(w.inputs)])
        assert err.value.code == "path_outside_roots"
    finally:
        inside.unlink()


def test_inputs_that_are_not_regular_files_are_refused_before_opening(worker):
    fifo = worker.inputs / "fifo.mp4"
    os.mkfifo(fifo)
    try:
        started = time.monotonic()
        assert decode(worker, fifo) == decode(worker, fifo)  # answered, twice
        reply = decode(worker, fifo)
        assert (reply["ok"], reply["code"]) == (False, "bad_request")
        assert "FIFO" in reply["message"]
        with worker.http() as h:
            r = h.post("/v1/probe", json={"paths": [str(fifo)]})
            assert (r.status_code, r.json()["code"]) == (400, "not_a_regular_file")
            clip = make_clip(frames=2, height=16, width=16)
            key = f"/framewire-test-{secrets.token_hex(6)}"
            Path(f"/dev/shm{key}").write_bytes(raw_bytes(clip))
            try:
                body = encode_body(shm_source(key, clip), "fifo-audio.mp4", audio=str(fifo))
                r = h.post("/v1/videos:encode", json=body)
            finally:
                Path(f"/dev/shm{key}").unlink()
            assert (r.status_code, r.json()["code"]) == (400, "not_a_regular_file")
            assert h.get("/healthz").status_code == 200
        assert time.monotonic() - started < 10  # nothing waited for a writer
    finally:
        fifo.unlink()


# --- outputs ------------------------------------------------------------------------------


def test_output_names_and_formats_the_worker_does_not_own(worker, segments):
    clip = make_clip(frames=2, height=16, width=16)
    src = segments.source(clip)
    before = set(worker.outputs.rglob("*"))
    cases = {
        ".framewire-tmp-999999-deadbeefdeadbeef/keep.mp4": "reserved_name",
        "a/.framewire-tmp-1-x/keep.mp4": "reserved_name",
        "list.m3u8": "unsupported_output_format",
        "frame%03d.png": "unsupported_output_format",
        "still.png": "unsupported_output_format",
        "dash.mpd": "unsupported_output_format",
        "noext": "unsupported_output_format",
        "new/dir/list.m3u8": "unsupported_output_format",
    }
    with worker.http() as h:
        for path, code in cases.items():
            r = h.post("/v1/videos:encode", json=encode_body(src, path))
            assert (r.status_code, r.json()["code"]) == (400, code), (path, r.text)
    assert set(worker.outputs.rglob("*")) == before, "a refused request left something"


def test_legal_long_names_work(worker, segments, tmp_path):
    clip = make_clip(frames=2, height=16, width=16)
    for name in ("n" * 251 + ".mp4", "x" + "é" * 125 + ".mp4"):  # 255 bytes each
        assert len(name.encode()) == 255
        with worker.http() as h:
            r = h.post("/v1/videos:encode", json=encode_body(segments.source(clip), name))
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["sha256"] == sha256(worker.outputs / name)
        assert sha256(worker.outputs / name) == reference_mp4(clip, tmp_path / "ref.mp4")
        (worker.outputs / name).unlink()


def test_the_start_up_sweep_keeps_every_answered_output(workers, segments):
    w = workers.start()
    clip = make_clip(frames=2, height=16, width=16)
    with w.http() as h:
        # What the sweep once took for a killed worker's directory, now refused...
        r = h.post(
            "/v1/videos:encode",
            json=encode_body(
                segments.source(clip), (".framewire-tmp-999999-deadbeefdeadbeef/keep.mp4")
            ),
        )
        assert r.json()["code"] == "reserved_name"
        # ...and what was answered 200 stays through a restart.
        r = h.post("/v1/videos:encode", json=encode_body(segments.source(clip), "d/keep.mp4"))
        assert r.status_code == 200
    assert w.stop() == 0
    assert workers.start(root=w.uds.parent).stop() == 0  # its start-up sweep ran
    assert sha256(w.outputs / "d" / "keep.mp4") == r.json()["outputs"][0]["sha256"]


# --- the caller's own rights -------------------------------------------------------------


def make_segment(clip, owner: int) -> str:
    key = f"/framewire-test-{secrets.token_hex(6)}"
    path = Path(f"/dev/shm{key}")
    path.write_bytes(raw_bytes(clip))
    path.chmod(0o600)
    os.chown(path, owner, owner)
    return key


@needs_root
@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_caller_cannot_have_the_worker_read_what_it_may_not(worker, transport, tmp_path):
    clip = make_clip(frames=2, height=16, width=16)
    url = worker.uds_url if transport == "unix" else worker.tcp_url
    roots_before = set(worker.outputs.rglob("*"))
    theirs, mine = make_segment(clip, 0), make_segment(clip, NOBODY)
    try:
        body = encode_body(shm_source(theirs, clip), f"stolen-{transport}.mp4")
        assert as_nobody(post_json, url, "/v1/videos:encode", body) == (
            403,
            "caller_not_permitted",
        )
        assert set(worker.outputs.rglob("*")) == roots_before
        # Registering it as a region is refused the same way; so is using root's region.
        reg = {"key": theirs, "offset": 0, "byte_size": len(raw_bytes(clip))}
        route = f"/v2/systemsharedmemory/region/r{transport}/register"
        assert as_nobody(post_json, url, route, reg) == (403, "caller_not_permitted")
        with worker.http() as h:
            route = f"/v2/systemsharedmemory/region/mine-{transport}/register"
            assert h.post(route, json=reg).status_code == 200
            region = shm_source(theirs, clip) | {"kind": "region", "region": f"mine-{transport}"}
            del region["key"]
            body = encode_body(region, f"stolen-region-{transport}.mp4")
            assert as_nobody(post_json, url, "/v1/videos:encode", body) == (
                403,
                "caller_not_permitted",
            )
            h.post(f"/v2/systemsharedmemory/region/mine-{transport}/unregister")
        # Its own segment is fine: the check is the caller's rights, nothing broader.
        body = encode_body(shm_source(mine, clip), f"own-{transport}.mp4")
        assert as_nobody(post_json, url, "/v1/videos:encode", body) == (200, "")
        assert sha256(worker.outputs / f"own-{transport}.mp4") == reference_mp4(
            clip, tmp_path / "ref.mp4"
        )
        (worker.outputs / f"own-{transport}.mp4").unlink()
    finally:
        for key in (theirs, mine):
            Path(f"/dev/shm{key}").unlink(missing_ok=True)


@needs_root
def test_a_caller_cannot_write_where_it_may_not(worker, segments):
    clip = make_clip(frames=2, height=16, width=16)
    private = worker.outputs / "roots-only"
    private.mkdir(mode=0o755, exist_ok=True)
    key = make_segment(clip, NOBODY)
    try:
        body = encode_body(shm_source(key, clip), "roots-only/x.mp4")
        got = as_nobody(post_json, worker.uds_url, "/v1/videos:encode", body)
        assert got == (403, "caller_not_permitted")
        body = encode_body(shm_source(key, clip), "roots-only/new/x.mp4")  # nor make dirs there
        assert as_nobody(post_json, worker.uds_url, "/v1/videos:encode", body)[0] == 403
        assert list(private.iterdir()) == []
    finally:
        Path(f"/dev/shm{key}").unlink()
        private.rmdir()


@needs_root
def test_directories_made_for_a_caller_are_the_caller_s(worker, tmp_path):
    clip = make_clip(frames=2, height=16, width=16)
    key = make_segment(clip, NOBODY)
    made = worker.outputs / "for-nobody"
    try:
        for name in ("a", "b"):  # the second output goes where the first made the directories
            body = encode_body(shm_source(key, clip), f"for-nobody/deep/{name}.mp4")
            assert as_nobody(post_json, worker.uds_url, "/v1/videos:encode", body) == (200, "")
        for directory in (made, made / "deep"):
            st = directory.stat()
            assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY), directory
        want = reference_mp4(clip, tmp_path / "ref.mp4")
        assert sha256(made / "deep" / "a.mp4") == sha256(made / "deep" / "b.mp4") == want
    finally:
        Path(f"/dev/shm{key}").unlink()
        shutil.rmtree(made, ignore_errors=True)


@needs_root
def test_a_decode_of_a_video_the_caller_may_not_read_is_forbidden(world):
    w = world["worker"]  # uid 65534 is allowed on its fd socket
    video = w.inputs / "private.mp4"
    make_video(video, "testsrc2=size=64x48:rate=24", 0.5)

    def ask() -> tuple[object, object]:
        reply = decode(w, video)
        return reply["ok"], reply.get("code")

    try:
        assert as_nobody(ask) == (True, None)  # 0644: theirs to read
        video.chmod(0o600)
        os.utime(video)  # a new identity: not answered from the cache
        assert as_nobody(ask) == (False, "forbidden")
        assert decode(w, video)["ok"] is True  # the worker's own uid may
    finally:
        video.unlink()


def test_unknown_callers_need_the_token():
    from framewire.core.errors import Forbidden
    from framewire.service._access.peers import READ, Access, tcp_peer

    # Not loopback: whoever it is, the host's socket table cannot vouch for them.
    assert tcp_peer(("192.0.2.7", 40000), ("192.0.2.1", 7700)) is None
    st = os.stat("/")
    with pytest.raises(Forbidden) as err:
        Access(None, trusted=False).check(st, READ, "a segment")
    assert err.value.code == "caller_unknown"
    Access(None, trusted=True).check(st, READ, "a segment")  # with the token: as the worker


# --- the token, the log ------------------------------------------------------------------


def test_the_token_guards_the_docs_and_schema_and_must_be_usable(workers):
    w = workers.start("--token", "t0ken")
    with w.http() as h:
        for route in ("/docs", "/redoc", "/openapi.json", "/metrics", "/v1/info"):
            r = h.get(route)
            assert (r.status_code, r.json()["code"]) == (401, "unauthorized"), route
        assert h.get("/healthz").status_code == 200
    with w.http("t0ken") as h:
        assert h.get("/openapi.json").status_code == 200
    for bad in ("", " ", "a b", "tab\there"):
        with pytest.raises(RuntimeError) as err:
            workers.start(env=os.environ | {"FRAMEWIRE_TOKEN": bad})
        assert "FRAMEWIRE_TOKEN" in str(err.value)


def test_a_newline_in_a_request_cannot_forge_a_log_line(workers, segments):
    w = workers.start("--log-level", "warning")
    (w.inputs / "broken.wav").write_bytes(b"RIFF but not really a wave file")
    forged = "x\n2026-01-01T00:00:00.000+00:00 WARNING framewire.app: forged.mp4"
    with w.http() as h:
        body = encode_body(segments.source(make_clip(frames=2)), forged, audio="broken.wav")
        r = h.post("/v1/videos:encode", json=body)
        assert r.status_code == 422, r.text  # ffmpeg failed: logged, with the path
    log = w.log.read_text()
    assert "x\\n2026-01-01" in log  # the newline, escaped
    assert not any(line.startswith("2026-01-01") for line in log.splitlines()), log
