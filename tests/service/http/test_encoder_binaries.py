"""The encoder binaries as a worker serves them, against a local user who may change files
and a bad day that removes them: refused at the start when another user could change them,
run from the descriptor they were hashed from, refused by name once they stop running
(the others serving on), their colours checked, and readiness that a flood cannot turn into
a flood of processes."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from framewire.client import Client, Conflict, ffmpeg_identity

from tests.service.encode.test_binaries import OTHER_UID, script, swapping
from tests.support.media import FFMPEG
from tests.support.worker import metric

FRAMES = np.random.default_rng(5).integers(0, 255, (4, 32, 48, 3), np.uint8)


def wrapper(path: Path, ffmpeg: str | Path = FFMPEG, before: str = "") -> Path:
    """A binary of its own identity that encodes exactly as ``ffmpeg`` does."""
    return script(path, f'{before}exec {ffmpeg} "$@"')


def encoder(fw: Client, path: Path) -> dict:
    [found] = [e for e in fw.info()["encoders"] if e.get("path") == str(path)]
    return found


@pytest.mark.parametrize("flag", ["--encoders", "--ffmpeg", "--decode-ffmpeg"])
def test_a_binary_another_user_can_change_stops_the_start(workers, tmp_path, flag):
    env = tmp_path / "engine-env" / "bin"  # an engine's environment, another uid's
    env.mkdir(parents=True)
    exe = wrapper(env / "ffmpeg")
    os.chown(env, OTHER_UID, OTHER_UID)
    with pytest.raises(RuntimeError) as refused:
        workers.start(flag, str(exe))
    assert f"{env} (owner uid {OTHER_UID}, mode 755) belongs to another user" in str(refused.value)
    assert "binary_not_trusted" in str(refused.value)


def test_a_file_renamed_over_an_encoder_never_runs(workers, tmp_path):
    env = tmp_path / "env"
    env.mkdir()
    marker = tmp_path / "ran"
    hostile = wrapper(env / "new", before=f"touch {marker}\n")
    # The same size and mtime as the file it replaces: only its inode differs.
    exe = wrapper(
        env / "ffmpeg", before="#" * (hostile.stat().st_size - 22 - len(str(FFMPEG))) + "\n"
    )
    assert hostile.stat().st_size == exe.stat().st_size
    os.utime(hostile, ns=(exe.stat().st_atime_ns, exe.stat().st_mtime_ns))
    held = ffmpeg_identity(exe)
    w = workers.start("--encoders", str(exe))
    os.rename(hostile, exe)
    with Client(w.uds_url) as fw:
        assert encoder(fw, exe)["id"] == held  # what it holds, not what the path names
        ok = fw.save_video(FRAMES, w.outputs / "a.mp4", fps=24, encoder=held)
        want = fw.save_video(FRAMES, w.outputs / "b.mp4", fps=24)
        assert ok.sha256 == want.sha256  # the wrapper's encode: the default's bytes
        with pytest.raises(Conflict, match="encoder_unavailable"):
            fw.save_video(FRAMES, w.outputs / "c.mp4", fps=24, encoder=ffmpeg_identity(exe))
    assert not marker.exists()
    assert sorted(p.name for p in w.outputs.iterdir()) == ["a.mp4", "b.mp4"]


def test_an_encoder_rewritten_in_place_is_named_by_its_new_bytes(workers, tmp_path):
    exe = wrapper(tmp_path / "ffmpeg", before="true\n")
    old = ffmpeg_identity(exe)
    w = workers.start("--encoders", str(exe))
    st = exe.stat()
    time.sleep(0.01)
    exe.write_text(exe.read_text().replace("true\n", ":   \n"))  # the same size
    os.utime(exe, ns=(st.st_atime_ns, st.st_mtime_ns))
    with Client(w.uds_url) as fw:
        now = encoder(fw, exe)
        assert now["id"] != old and now["sha256"] == ffmpeg_identity(exe).split(":")[1]
        with pytest.raises(Conflict, match="encoder_unavailable"):
            fw.save_video(FRAMES, w.outputs / "old.mp4", fps=24, encoder=old)
        assert fw.save_video(FRAMES, w.outputs / "new.mp4", fps=24, encoder=now["id"]).ok


def test_an_encoder_whose_path_vanishes_serves_on(workers, tmp_path):
    env = tmp_path / "env"
    env.mkdir()
    exe = wrapper(env / "ffmpeg")
    link = tmp_path / "ffmpeg-link"
    link.symlink_to(exe)
    held = ffmpeg_identity(exe)
    w = workers.start("--encoders", str(link))
    exe.unlink()
    env.rmdir()  # the environment removed: a dangling link left in its place
    with Client(w.uds_url) as fw:
        about = encoder(fw, exe)
        assert (about["id"], about["available"]) == (held, True)
        got = fw.save_video(FRAMES, w.outputs / "a.mp4", fps=24, encoder=held)
        assert got.sha256 == fw.save_video(FRAMES, w.outputs / "b.mp4", fps=24).sha256


def test_an_encoder_that_stops_running_is_refused_by_name_while_the_others_serve(workers, tmp_path):
    lib = tmp_path / "lib"  # what the binary needs to run, beside it (its libraries, say)
    lib.mkdir()
    (lib / "ffmpeg").symlink_to(FFMPEG)
    exe = wrapper(tmp_path / "ffmpeg", lib / "ffmpeg")
    held = ffmpeg_identity(exe)
    w = workers.start("--encoders", str(exe))
    (lib / "ffmpeg").unlink()
    with Client(w.uds_url) as fw:
        for _ in range(2):
            # Found by the first encode that fails (a healthy encode starts no check),
            # then refused before any encode.
            with pytest.raises(Conflict) as refused:
                fw.save_video(FRAMES, w.outputs / "lost.mp4", fps=24, encoder=held)
            assert refused.value.code == "encoder_unavailable"
            assert "does not run" in refused.value.message
            about = encoder(fw, exe)
            assert (about["id"], about["available"]) == (held, False)
            assert "exited" in about["why"]
            assert fw.info()["encoders"][0]["available"] is True
            assert fw.save_video(FRAMES, w.outputs / "default.mp4", fps=24).ok
    with w.http() as h:
        assert metric(h, "framewire_encoders_lost") == 1
        assert h.get("/readyz").status_code == 200  # the default runs: the worker serves
    logged = [line for line in w.log.read_text().splitlines() if "does not run" in line]
    assert len(logged) == 1 and str(exe) in logged[0]
    assert sorted(p.name for p in w.outputs.iterdir()) == ["default.mp4"]


def test_an_encoder_with_wrong_colours_is_left_out_and_a_default_with_them_stops_the_start(
    workers, tmp_path
):
    swapped = swapping(tmp_path)
    w = workers.start("--encoders", str(swapped))
    with Client(w.uds_url) as fw:
        assert str(swapped) not in [e.get("path") for e in fw.info()["encoders"]]
        with pytest.raises(Conflict, match="encoder_unavailable"):
            fw.save_video(FRAMES, w.outputs / "x.mp4", fps=24, encoder=ffmpeg_identity(swapped))
    with w.http() as h:
        assert metric(h, "framewire_encoders_refused") == 1
    logged = w.log.read_text()
    assert "colours are wrong" in logged and "red came out" in logged
    with pytest.raises(RuntimeError) as refused:
        workers.start("--ffmpeg", str(swapped))
    assert "encoder_colours" in str(refused.value) and "blue came out" in str(refused.value)


def test_readiness_runs_one_version_at_a_time_however_many_ask(workers, tmp_path):
    asked = tmp_path / "asked"
    counting = f'[ "$2" = -version ] && echo >> {asked}\n'
    w = workers.start("--ffmpeg", str(wrapper(tmp_path / "ffmpeg", before=counting)))
    routes = ["/readyz", "/v2/health/ready", "/metrics"]
    failures: list[object] = []

    def flood() -> None:
        with w.http() as h:
            for i in range(30):
                r = h.get(routes[i % 3])
                if r.status_code != 200:
                    failures.append(r.status_code)

    t0 = time.monotonic()
    threads = [threading.Thread(target=flood) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - t0
    assert failures == []
    versions = len(asked.read_text().splitlines())
    # One -version per RUNS_TTL_S (2 s), not one per request (360 of them).
    assert 1 <= versions <= took / 2 + 2, (versions, took)
