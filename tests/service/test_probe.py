"""In-process media facts with PyAV."""

from __future__ import annotations

import pytest
import torch
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


def _read_by(call):
    """What ``call`` returns, and the bytes this process read meanwhile (/proc/self/io)."""

    def rchar() -> int:
        with open("/proc/self/io") as io:
            return int(next(line for line in io if line.startswith("rchar:")).split()[1])

    before = rchar()
    got = call()
    return got, rchar() - before


@pytest.mark.parametrize("ext", [".mp4", ".mov", ".mkv"])
def test_an_outputs_check_reads_the_header_alone_where_it_says_it_all(tmp_path, wav, ext):
    """MP4 and MOV hold every stream's facts in their moov: an output's check reads that
    and the index, not megabytes of packets, and learns the same facts; any other file
    (MKV) is read as before."""
    import av
    from framewire.core.media.inputs import InputFile
    from framewire.core.wire import MediaInfo
    from framewire.service import _probe

    out = tmp_path / f"a{ext}"
    noise = torch.rand(3, 24, 256, 320, generator=torch.Generator().manual_seed(0))
    Encoder().encode(TensorSource(noise), out, EncodeParams(fps=24, audio=wav, quality=10))
    size = out.stat().st_size
    assert size > 2 << 20  # past what a full open reads ahead of its streams' facts
    quick, read = _read_by(lambda: probe(out, pixel_format=False, header_only=True))

    def as_before() -> MediaInfo:  # opened with the defaults alone
        with InputFile.open(out) as source, _probe._open(av, source, {}, False) as container:
            return _probe._facts(av, container, source.name)

    full, read_before = _read_by(as_before)
    assert quick == full and quick.audio is not None and quick.frames == 24
    if ext == ".mkv":
        assert read >= read_before  # its header read, then the whole read as before
    else:
        assert read < (1 << 20) < read_before
