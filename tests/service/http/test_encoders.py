"""The encoder is part of the contract: a worker holding two ffmpeg builds reports both in
/v1/info, encodes with the one a request names (the same bytes as that binary's own run
of the reference argv), and refuses an identity it does not hold."""

from __future__ import annotations

import numpy as np
import pytest
from framewire.client import BadRequest, Client, Conflict, ffmpeg_identity, pyav_identity

from tests.support.engine_site import engine_ffmpeg, engine_site
from tests.support.engines import sglang_save
from tests.support.media import FFMPEG

pytestmark = pytest.mark.registry


@pytest.fixture(scope="module")
def old_ffmpeg():
    return str(engine_ffmpeg(engine_site("sglang")))  # imageio-ffmpeg 0.5.1's 4.2.2


def test_info_lists_each_binary_and_a_request_picks_one(workers, tmp_path, old_ffmpeg):
    import av
    import torch

    worker = workers.start("--encoders", old_ffmpeg)
    with Client(worker.uds_url) as fw:
        encoders = fw.info()["encoders"]
        ids = [e["id"] for e in encoders]
        assert ids == [ffmpeg_identity(FFMPEG), ffmpeg_identity(old_ffmpeg),
                       pyav_identity(av.__version__)]  # fmt: skip
        assert encoders[0]["default"] and not encoders[1]["default"]
        assert encoders[1]["libx264"] == "core 159 r2991 1771b55"
        assert encoders[1]["version"].startswith("ffmpeg version 4.2.2")
        video = torch.rand(3, 8, 48, 64, generator=torch.Generator().manual_seed(3))
        shas = {}
        for name, exe in (("new", FFMPEG), ("old", old_ffmpeg)):
            result = fw.save_video(video, worker.outputs / f"{name}.mp4", fps=24,
                                   profile="sglang", encoder=ffmpeg_identity(exe))  # fmt: skip
            assert result.sha256 == sglang_save(video, tmp_path / f"{name}.mp4", fps=24, ffmpeg=exe)
            shas[name] = result.sha256
        assert shas["new"] != shas["old"]  # the bytes follow the binary


def test_an_identity_the_worker_lacks_is_409_and_leaves_nothing(worker, old_ffmpeg):
    frames = np.zeros((4, 32, 32, 3), np.uint8)
    with Client(worker.uds_url) as fw:
        with pytest.raises(Conflict) as refused:
            fw.save_video(frames, worker.outputs / "x.mp4", fps=24,
                          encoder=ffmpeg_identity(old_ffmpeg))  # fmt: skip
        assert refused.value.code == "encoder_unavailable"
        with pytest.raises(Conflict, match="encoder_unavailable"):
            fw.save_video(frames, worker.outputs / "y.mp4", fps=24, profile="vllm-omni",
                          encoder="pyav:0.0.1")  # fmt: skip
        with pytest.raises(BadRequest) as bad:
            fw.save_video(frames, worker.outputs / "z.mp4", fps=24, encoder="ffmpeg 4.2")
        assert bad.value.code == "bad_encoder"
        assert fw.save_video(frames, worker.outputs / "t0.mp4", fps=24, threads=0).ok
    assert sorted(p.name for p in worker.outputs.iterdir()) == ["t0.mp4"]
