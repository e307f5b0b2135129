"""The worker's conversion route (FRAMEWIRE_KERNEL): reported in /v1/info, and byte-exact
whichever it is (the default, compiled, runs in every other encode test)."""

from __future__ import annotations

from framewire.client import Client

from tests.support.media import make_clip, reference_mp4, with_specials


def test_a_worker_on_the_pure_route_gives_the_same_bytes(workers, tmp_path):
    w = workers.start("--kernel", "pure")
    with w.http() as h:
        assert h.get("/v1/info").json()["conversion"] == "pure"
    clip = with_specials(make_clip(frames=5, height=40, width=56))
    with Client(w.uds_url) as c:
        result = c.save_video(clip, "pure.mp4", fps=24)
    assert result.sha256 == reference_mp4(clip, tmp_path / "ref.mp4")


def test_a_default_worker_reports_the_compiled_route(worker):
    with worker.http() as h:
        assert h.get("/v1/info").json()["conversion"] == "compiled"
