"""The argv builders against what imageio-ffmpeg itself runs."""

from __future__ import annotations

from fractions import Fraction

import imageio_ffmpeg
import imageio_ffmpeg._io as iio
import pytest
from framewire.core.media.argv import (
    AUDIO_DEMUXERS,
    AUDIO_FILE_GUARD,
    GUARD_OPTIONS,
    PIPE_GUARD,
    VIDEO_DEMUXERS,
    VIDEO_FILE_GUARD,
    crf_for_quality,
    decode_argv,
    encode_argv,
    fps_arg,
    padded_size,
    unguarded,
    x264_auto_threads,
)
from framewire.core.wire import DecodeRequest


class _Captured(Exception):
    pass


def imageio_argv(monkeypatch: pytest.MonkeyPatch, path: str, size: tuple[int, int], **kw: object):
    seen: list[list[str]] = []

    def fake_popen(cmd: list[str], **_: object):
        seen.append(list(cmd))
        raise _Captured

    monkeypatch.setattr(iio.subprocess, "Popen", fake_popen)
    gen = imageio_ffmpeg.write_frames(path, size, codec="libx264", **kw)
    with pytest.raises(_Captured):
        gen.send(None)
    return seen[0]


@pytest.mark.parametrize(
    ("size", "fps", "quality", "preset", "audio"),
    [
        ((64, 48), 24, 5, "fast", None),
        ((100, 75), 23.976, 3, "ultrafast", None),
        ((1344, 768), 16, 8, "fast", "/in/a.wav"),
        ((30, 17), Fraction(30000, 1001), 10, "medium", "/in/b.wav"),
        ((64, 48), 24, 1, "fast", None),
    ],
)
def test_reference_argv_is_write_frames_argv(monkeypatch, size, fps, quality, preset, audio):
    output_params = ["-preset", preset]
    kw: dict[str, object] = {"fps": fps, "quality": quality, "output_params": output_params}
    if audio:
        kw |= {"audio_path": audio, "audio_codec": "aac"}
    expected = imageio_argv(monkeypatch, "/out/x.mp4", size, **kw)
    args = {
        "width": size[0],
        "height": size[1],
        "fps": fps,
        "output": "/out/x.mp4",
        "quality": quality,
        "preset": preset,
        "audio": audio,
        "stdin_name": "-",
    }
    assert encode_argv(expected[0], **args, guard=False) == expected
    # The guards are the only thing a guarded argv adds.
    assert unguarded(encode_argv(expected[0], **args)) == expected


def test_threads_sit_where_output_params_put_them(monkeypatch):
    expected = imageio_argv(
        monkeypatch,
        "/o.mp4",
        (64, 48),
        fps=24,
        output_params=["-preset", "fast", "-threads", "3"],
        audio_path="/a.wav",
        audio_codec="aac",
    )
    ours = encode_argv(
        expected[0],
        width=64,
        height=48,
        fps=24,
        output="/o.mp4",
        threads=3,
        audio="/a.wav",
        stdin_name="-",
        guard=False,
    )
    assert ours == expected


def test_guards_sit_before_each_input_and_add_nothing_else():
    argv = encode_argv(
        "ffmpeg", width=64, height=48, fps=24, output="/o.mp4", audio="/proc/self/fd/7"
    )
    _, second = (i for i, token in enumerate(argv) if token == "-i")
    assert argv[1:4] == ["-y", *PIPE_GUARD]  # before input 0's options
    assert argv[second - 4 : second] == list(AUDIO_FILE_GUARD)
    assert [t for t in argv if t in GUARD_OPTIONS] == [
        "-protocol_whitelist", "-protocol_whitelist", "-format_whitelist"
    ]  # fmt: skip
    request = DecodeRequest(path="/proc/self/fd/5", fps=24, width=64, height=48)
    decode = decode_argv("ffmpeg", request)
    at = decode.index("-i")
    assert decode[at - 4 : at] == list(VIDEO_FILE_GUARD)
    assert unguarded(decode) == decode_argv("ffmpeg", request, guard=False)
    for demuxers in (VIDEO_DEMUXERS, AUDIO_DEMUXERS):
        # None of the demuxers that open other files by what a file says.
        assert not {"hls", "dash", "concat", "image2", "ffmetadata", "imf"} & set(
            demuxers.split(",")
        )


def test_fast_path_argv_differs_only_in_input_and_threads():
    ref = encode_argv(
        "ffmpeg", width=64, height=48, fps=24, output="/o.mp4", stdin_name="-", guard=False
    )
    fast = encode_argv(
        "ffmpeg", width=64, height=48, fps=24, output="/o.mp4", threads=2, guard=False
    )
    assert fast[: ref.index("-")] == ref[: ref.index("-")]
    assert fast[ref.index("-")] == "pipe:0"
    assert fast[-3:] == ["-threads", "2", "/o.mp4"]


def test_scalars():
    assert fps_arg(23.976) == "2997/125"
    assert fps_arg(24.0) == "24"
    assert fps_arg(Fraction(24000, 1001)) == "24000/1001"
    assert [crf_for_quality(q) for q in (1, 3, 5, 8, 10)] == [45, 35, 25, 10, 0]
    assert padded_size(100, 75) == (112, 80)
    assert padded_size(64, 48) == (64, 48)


def test_x264_auto_threads_formula():
    assert x264_auto_threads(768, cpus=2) == 3
    assert x264_auto_threads(768, cpus=16) == 24
    assert x264_auto_threads(48, cpus=16) == 1  # 3 macroblock rows -> 1
    assert x264_auto_threads(75, cpus=16) == 2  # 5 rows after padding to 80
    assert x264_auto_threads(8192, cpus=256) == 128


def test_decode_argv():
    request = DecodeRequest(path="/in/v.mp4", fps=24, width=1344, height=768)
    plain = decode_argv("ffmpeg", request, guard=False)
    assert plain == [
        "ffmpeg",
        "-v",
        "error",
        "-i",
        "/in/v.mp4",
        "-map",
        "0:v:0",
        "-an",
        "-vf",
        "fps=24,scale=1344:768:flags=lanczos,setsar=1",
        "-f",
        "rawvideo",
        "-pix_fmt",
        "rgb24",
        "pipe:1",
    ]
    request = DecodeRequest(
        path="/in/v.mp4", fps=23.976, width=9, height=7, start=1.5, max_frames=4
    )
    argv = decode_argv("ffmpeg", request, out_fd=3, guard=False)
    assert decode_argv("ffmpeg", request, path="/proc/self/fd/5", out_fd=3, guard=False) == [
        *argv[:6], "/proc/self/fd/5", *argv[7:]
    ]  # fmt: skip
    assert argv[3:5] == ["-ss", "1.5"]
    assert "fps=23.976,scale=9:7:flags=lanczos,setsar=1" in argv
    assert argv[-7:-5] == ["-frames:v", "4"]
    assert argv[-1] == "pipe:3"


def test_engine_profiles_spell_the_rate_and_preset_as_their_engines_do():
    from framewire.core.media.argv import encode_argv, pyav_argv

    kw = {"width": 34, "height": 30, "fps": 23.976, "output": "o.mp4", "guard": False}
    sglang = encode_argv("ffmpeg", profile="sglang", quality=5.5, preset=None, **kw)
    assert sglang[sglang.index("-r") + 1] == "23.98"
    assert sglang[sglang.index("-crf") + 1] == "22"
    assert sglang[sglang.index("-preset") + 1] == "fast"
    diffusers = encode_argv("ffmpeg", profile="diffusers", quality=None, preset=None, **kw)
    assert "-preset" not in diffusers and diffusers[diffusers.index("-r") + 1] == "2997/125"
    assert diffusers[diffusers.index("-vf") + 1] == "scale=48:32"
    child = pyav_argv(["python", "-m", "writer"], width=34, height=30, fps=23.976, output="o.mp4")
    assert child[child.index("--rate") + 1] == "2997/125"
    assert child[child.index("--crf") + 1] == "18" and child[child.index("--threads") + 1] == "0"
