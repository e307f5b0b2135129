"""An encoder's colours, checked once when the worker starts.

A build of ffmpeg whose RGB to YUV conversion is wrong (one made without its assembly has
turned red into magenta elsewhere) still writes files a byte-exact copy reproduces, wrong.
So each encoder encodes eight colour bars once, losslessly (x264 at qp 0, so only the
conversion can change a value), the same binary decodes the stream to raw yuv420p, and
each bar's Y, Cb and Cr must come within :data:`TOLERANCE` of BT.601's limited range,
which ffmpeg's conversion uses when no colour matrix is named, as no profile names one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import ModuleType

import numpy as np
from framewire.core.errors import FramewireError
from framewire.core.media.pipe import FfmpegExited
from framewire.core.media.process import FfmpegProcess

# White, yellow, cyan, green, magenta, red, blue, black: each primary and its complement.
BARS = (
    (255, 255, 255), (255, 255, 0), (0, 255, 255), (0, 255, 0),
    (255, 0, 255), (255, 0, 0), (0, 0, 255), (0, 0, 0),
)  # fmt: skip
NAMES = ("white", "yellow", "cyan", "green", "magenta", "red", "blue", "black")
BAR_W, HEIGHT = 8, 16
WIDTH = BAR_W * len(BARS)
# ffmpeg's integer conversion rounds within a level of the exact one; a swapped channel or
# a wrong matrix moves some bar by tens of levels.
TOLERANCE = 3
CHECK_TIMEOUT_S = 20.0


def pattern() -> np.ndarray:
    """The bars as one rgb24 frame, ``(HEIGHT, WIDTH, 3)``."""
    row = np.repeat(np.array(BARS, np.uint8), BAR_W, axis=0)
    return np.ascontiguousarray(np.broadcast_to(row, (HEIGHT, WIDTH, 3)))


def expected() -> np.ndarray:
    """Each bar's (Y, Cb, Cr) in BT.601's limited range, ``(8, 3)`` floats."""
    rgb = np.array(BARS, np.float64) / 255
    matrix = np.array(
        [[65.481, 128.553, 24.966], [-37.797, -74.203, 112.0], [112.0, -93.786, -18.214]]
    )
    out: np.ndarray = rgb @ matrix.T + np.array([16.0, 128.0, 128.0])
    return out


@dataclass(frozen=True)
class ColourCheck:
    ok: bool
    problem: str  # what came out wrong; "" when ok
    stream: bytes  # the H.264 stream the encoder wrote (its x264 names its build in it)
    ran: bool = True  # False: the encoder did not run at all, so nothing was judged


def judge(yuv420p: bytes, stream: bytes) -> ColourCheck:
    """Compare a decoded frame of the bars (raw yuv420p) with :func:`expected`."""
    luma = WIDTH * HEIGHT
    if len(yuv420p) < luma * 3 // 2:
        return ColourCheck(False, f"decoded {len(yuv420p)} bytes, not one frame", stream)
    planes = np.frombuffer(yuv420p, np.uint8, luma * 3 // 2)
    y = planes[:luma].reshape(HEIGHT, WIDTH)
    cb = planes[luma : luma * 5 // 4].reshape(HEIGHT // 2, WIDTH // 2)
    cr = planes[luma * 5 // 4 :].reshape(HEIGHT // 2, WIDTH // 2)
    wrong = []
    for i, want in enumerate(expected()):
        # The middle of each bar: a scaler's chroma filter may blend the edges.
        mid, half = i * BAR_W + BAR_W // 2, (i * BAR_W + BAR_W // 2) // 2
        got = (
            float(y[:, mid - 2 : mid + 2].mean()),
            float(cb[:, half - 1 : half + 1].mean()),
            float(cr[:, half - 1 : half + 1].mean()),
        )
        off = max(abs(g - w) for g, w in zip(got, want, strict=True))
        if off > TOLERANCE:
            shown = "/".join(f"{v:.0f}" for v in got)
            wanted = "/".join(f"{v:.0f}" for v in want)
            wrong.append(f"{NAMES[i]} came out Y/Cb/Cr {shown}, not {wanted}")
    problem = "; ".join(wrong)
    if problem:
        problem += f" (BT.601 limited range, within {TOLERANCE})"
    return ColourCheck(not wrong, problem, stream)


def _run(argv: list[str], data: bytes) -> tuple[int, bytes, str]:
    with FfmpegProcess(argv, stdout=True, stall_s=CHECK_TIMEOUT_S) as ff:
        assert ff.input is not None
        with contextlib.suppress(FfmpegExited):  # it stopped reading: its status says why
            ff.input.send(memoryview(data))
        rc = ff.wait()
        return rc, ff.stdout_bytes(), ff.stderr_tail()


def check_ffmpeg(exe: str) -> ColourCheck:
    """Encode the bars with ``exe`` as an encode converts them (rgb24 in, libx264 at
    yuv420p out), decode them with it, and judge the colours."""
    raw = ["-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{WIDTH}x{HEIGHT}", "-i", "pipe:0"]
    encode = [exe, "-v", "error", *raw, "-frames:v", "1", "-c:v", "libx264", "-qp", "0"]
    encode += ["-pix_fmt", "yuv420p", "-f", "h264", "pipe:1"]
    decode = [exe, "-v", "error", "-f", "h264", "-i", "pipe:0"]
    decode += ["-f", "rawvideo", "-pix_fmt", "yuv420p", "pipe:1"]
    try:
        rc, stream, err = _run(encode, pattern().tobytes())
        if rc != 0 or not stream:
            return ColourCheck(False, f"it exited {rc}: {err.strip()[-300:]}", b"", ran=False)
        rc, yuv, err = _run(decode, stream)
        if rc != 0:
            return ColourCheck(False, f"the decode exited {rc}: {err.strip()[-300:]}", stream)
    except (FramewireError, OSError) as exc:
        return ColourCheck(False, f"it does not run: {exc}", b"", ran=False)
    return judge(yuv, stream)


def check_pyav(av: ModuleType) -> ColourCheck:
    """The same for PyAV, in this process: its encoder converts an rgb24 frame to the
    context's yuv420p as the vllm-omni profile's writer hands it one."""
    try:
        ctx = av.CodecContext.create("libx264", "w")
        ctx.width, ctx.height, ctx.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        ctx.options = {"qp": "0"}
        frame = av.VideoFrame.from_ndarray(pattern(), format="rgb24")
        packets = list(ctx.encode(frame)) + list(ctx.encode(None))
        stream = b"".join(bytes(p) for p in packets)
        dec = av.CodecContext.create("h264", "r")
        frames = [f for p in packets for f in dec.decode(p)] + list(dec.decode(None))
    except Exception as exc:  # any failure of a binary extension is the check's answer
        return ColourCheck(False, f"PyAV does not encode: {exc}", b"", ran=False)
    if not frames:
        return ColourCheck(False, "PyAV decoded no frame", b"")
    return judge(frames[0].reformat(format="yuv420p").to_ndarray().tobytes(), stream)
