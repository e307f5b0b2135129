"""Directories the worker made for an output are taken back once no request uses them.

Session A's path makes ``d/``; session B writes into ``d/`` too. Whichever ends
first, the directory goes only when the last of them has failed or been
aborted, and never from under one still open.
"""

from __future__ import annotations

from tests.service.stream.test_sessions import open_stream, send_frames
from tests.support.media import make_clip, reference_mp4, sha256
from tests.support.processes import framewire_temps

WORKER_ARGS = ("--stream-idle-s", "60")


def test_a_directory_shared_by_aborted_sessions_is_removed(worker, segments):
    clip = make_clip(frames=4, height=48, width=64)
    with worker.http() as h:
        a = open_stream(h, clip, path="shared/deeper/a.mp4")  # makes shared/ and deeper/
        b = open_stream(h, clip, path="shared/b.mp4")
        assert send_frames(h, segments, b, clip, 0, 2).status_code == 200  # B's temp is in it
        assert h.delete(f"/v1/streams/{a}").status_code == 204
        assert not (worker.outputs / "shared" / "deeper").exists()
        assert (worker.outputs / "shared").is_dir()  # B still writes there
        assert h.delete(f"/v1/streams/{b}").status_code == 204
    assert not (worker.outputs / "shared").exists()


def test_a_directory_is_not_removed_from_under_an_open_session(worker, segments, tmp_path):
    clip = make_clip(frames=4, height=48, width=64)
    with worker.http() as h:
        a = open_stream(h, clip, path="kept/a.mp4")  # makes kept/
        b = open_stream(h, clip, path="kept/b.mp4")  # nothing of B is in kept/ yet
        assert h.delete(f"/v1/streams/{a}").status_code == 204
        assert send_frames(h, segments, b, clip, 0, 4).status_code == 200
        r = h.post(f"/v1/streams/{b}/finish")
        assert r.status_code == 200, r.text
    out = worker.outputs / "kept" / "b.mp4"
    assert sha256(out) == reference_mp4(clip, tmp_path / "ref.mp4")
    assert framewire_temps(worker.outputs) == []
    out.unlink()
    (worker.outputs / "kept").rmdir()


def test_an_aborted_session_leaves_the_file_of_a_finished_one_beside_it(worker, segments):
    clip = make_clip(frames=2, height=48, width=64)
    with worker.http() as h:
        a = open_stream(h, clip, path="done/a.mp4")
        assert send_frames(h, segments, a, clip, 0, 2).status_code == 200
        assert h.post(f"/v1/streams/{a}/finish").status_code == 200
        b = open_stream(h, clip, path="done/b.mp4")
        assert h.delete(f"/v1/streams/{b}").status_code == 204
    assert (worker.outputs / "done" / "a.mp4").is_file()
    (worker.outputs / "done" / "a.mp4").unlink()
    (worker.outputs / "done").rmdir()
