"""open_video takes audio samples as save_video does: shared for the session's opening call,
the file the same bytes as save_video's of the whole clip with that audio."""

from __future__ import annotations

import numpy as np
import pytest
from framewire.client import Client

from tests.support.media import make_clip


@pytest.mark.parametrize(("profile", "rate", "channels"), [
    ("sglang", 16000, 1), ("vllm-omni", 24000, 2), ("imageio", 22050, 2),
])  # fmt: skip
def test_a_stream_with_audio_samples_has_save_videos_bytes(worker, profile, rate, channels):
    clip = make_clip(frames=8, height=48, width=64, seed=9)
    rng = np.random.default_rng(channels)
    audio = (rng.standard_normal((rate // 3, channels)) * 0.3).astype(np.float32)
    with Client(worker.uds_url, local_fallback=False) as fw:  # the worker's bytes, or fail
        whole = fw.save_video(clip, worker.outputs / f"{profile}-whole.mp4", fps=24,
                              profile=profile, audio=audio, audio_sample_rate=rate)  # fmt: skip
        with fw.open_video(worker.outputs / f"{profile}-stream.mp4", fps=24, profile=profile,
                           audio=audio, audio_sample_rate=rate) as writer:  # fmt: skip
            for t0 in range(0, 8, 3):
                writer.write(clip[:, t0 : t0 + 3])
    assert writer.result is not None and writer.result.audio is not None
    assert whole.route != "local" and writer.result.route != "local"
    assert writer.result.sha256 == whole.sha256


def test_a_local_stream_with_audio_samples_has_the_same_bytes(tmp_path, worker):
    clip = make_clip(frames=6, height=32, width=48, seed=2)
    audio = np.linspace(-0.5, 0.5, 8000, dtype=np.float32)
    with Client(worker.uds_url, local_fallback=False) as fw:  # the worker's bytes
        whole = fw.save_video(clip, worker.outputs / "w.mp4", fps=24, profile="sglang",
                              audio=audio, audio_sample_rate=16000)  # fmt: skip
    assert whole.route != "local"
    nobody = f"unix://{tmp_path / 'none.sock'}"
    local = Client(nobody, output_root=tmp_path)
    with local, local.open_video("s.mp4", fps=24, profile="sglang", audio=audio,
                                 audio_sample_rate=16000) as writer:  # fmt: skip
        writer.write(clip)
    assert writer.result is not None and writer.result.route == "local"
    assert writer.result.sha256 == whole.sha256
