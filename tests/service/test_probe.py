"""In-process media facts with PyAV."""

from __future__ import annotations

import pytest
from framewire.core.errors import MediaError, NotFound
from framewire.service._encode.encoder import EncodeParams, Encoder
from framewire.service._probe import probe
from framewire.service._sources.frames import TensorSource

from tests.support.media import make_clip


def test_probe_facts_of_an_encode(tmp_path, wav):
    out = tmp_path / "a.mp4"
    Encoder().encode(
        TensorSource(make_clip(frames=24, height=75, width=100)),
        out,
        EncodeParams(fps=23.976, audio=wav),
    )
    info = probe(out)
    assert (info.frames, info.width, info.height) == (24, 112, 80)
    assert info.fps_exact == "2997/125"
    assert info.codec == "h264" and info.pix_fmt == "yuv420p"
    assert info.duration == pytest.approx(24 / 23.976, abs=0.05)
    assert info.audio is not None and info.audio.codec == "aac" and info.audio.channels == 1
    # Without decoding (as outputs are validated): every fact the same but the pixel format.
    quick = probe(out, pixel_format=False)
    assert quick.pix_fmt is None
    assert quick.model_dump(exclude={"pix_fmt"}) == info.model_dump(exclude={"pix_fmt"})


def test_probe_without_audio(tmp_path):
    out = tmp_path / "a.mp4"
    Encoder().encode(TensorSource(make_clip(frames=5)), out, EncodeParams(fps=16))
    info = probe(out)
    assert (info.frames, info.fps, info.audio) == (5, 16.0, None)
    quick = probe(out, pixel_format=False)
    assert quick.model_dump(exclude={"pix_fmt"}) == info.model_dump(exclude={"pix_fmt"})


def test_probe_refusals(tmp_path):
    with pytest.raises(NotFound):
        probe(tmp_path / "missing.mp4")
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"\x00garbage" * 100)
    for pixel_format in (True, False):
        with pytest.raises(MediaError) as err:
            probe(junk, pixel_format=pixel_format)
        assert err.value.code == "not_video"
