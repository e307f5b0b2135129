"""Reference-decode test helpers: tiny clips, the plain-ffmpeg oracle, raw fd-socket calls.

Kept free of torch so the helper processes that import it start quickly.
"""

from __future__ import annotations

import array
import json
import os
import re
import socket
import struct
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import imageio_ffmpeg

FFMPEG = imageio_ffmpeg.get_ffmpeg_exe()

# (lavfi source, seconds): odd sizes, a 30 fps and a 25 fps source.
CLIP_30 = ("testsrc2=size=97x61:rate=30", 2.0)
CLIP_25 = ("testsrc2=size=97x61:rate=25", 1.6)

# Decode parameters (fps, width, height, start, max_frames) covering the argv's branches.
DECODE_CASES: list[dict[str, Any]] = [
    {"clip": "c30.mp4", "fps": 24, "width": 45, "height": 33},
    {"clip": "c25.mp4", "fps": 30, "width": 97, "height": 61},
    {"clip": "c30.mp4", "fps": 12.5, "width": 64, "height": 36, "start": 0.4, "max_frames": 7},
    {"clip": "c25.mp4", "fps": 23.976, "width": 33, "height": 19, "start": 1.0},
]


def case_id(case: dict[str, Any]) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items())


def make_video(path: Path, source: str, seconds: float, *, extra: tuple[str, ...] = ()) -> Path:
    subprocess.run(
        [FFMPEG, "-v", "error", "-y", "-f", "lavfi", "-i", source, "-t", str(seconds),
         "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p", *extra, str(path)],
        check=True,
        timeout=60,
    )  # fmt: skip
    return path


def make_clips(directory: Path) -> dict[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    return {
        "c30.mp4": make_video(directory / "c30.mp4", *CLIP_30),
        "c25.mp4": make_video(directory / "c25.mp4", *CLIP_25),
    }


def params(case: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in case.items() if k != "clip"}


def oracle(
    path: Path,
    *,
    fps: float,
    width: int,
    height: int,
    start: float = 0.0,
    max_frames: int | None = None,
) -> bytes:
    """The decode as a plain ffmpeg run with rgb24 on stdout, what ranks did before:
    the command of ../shared/DESIGN.md section 4 written out here, not built by the
    product (a change in its ``decode_argv`` must fail the decode tests)."""
    argv = [FFMPEG, "-v", "error"]
    if start > 0:
        argv += ["-ss", f"{start:.9g}"]
    argv += ["-i", os.fspath(path), "-map", "0:v:0", "-an"]
    argv += ["-vf", f"fps={fps:g},scale={width}:{height}:flags=lanczos,setsar=1"]
    if max_frames is not None:
        argv += ["-frames:v", str(max_frames)]
    argv += ["-f", "rawvideo", "-pix_fmt", "rgb24", "pipe:1"]
    return subprocess.run(argv, capture_output=True, check=True, timeout=60).stdout


class RawConnection:
    """The fd socket spoken by hand, to test the protocol itself."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(str(path))

    def send(self, raw: bytes, fds: Sequence[int] = ()) -> None:
        if fds:  # the whole line with the descriptors, as the client sends a register
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            sent = self.sock.sendmsg([raw], rights)
            raw = raw[sent:]
        if raw:  # (an empty send to a worker that already answered and closed is EPIPE)
            self.sock.sendall(raw)

    def reply(self) -> tuple[dict[str, Any], list[int]]:
        """(header, fds received with it); the caller closes the fds."""
        fds: list[int] = []
        head = self._exactly(4, fds)
        body = self._exactly(struct.unpack(">I", head)[0], fds)
        return json.loads(body), fds

    def call(self, message: Any, fds: Sequence[int] = ()) -> tuple[dict[str, Any], list[int]]:
        raw = message if isinstance(message, bytes) else json.dumps(message).encode() + b"\n"
        self.send(raw, fds)
        return self.reply()

    def _exactly(self, n: int, fds: list[int]) -> bytes:
        buf = b""
        while len(buf) < n:
            data, anc, _, _ = self.sock.recvmsg(n - len(buf), socket.CMSG_SPACE(16))
            for level, kind, cdata in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", cdata[: len(cdata) - len(cdata) % 4]))
            if not data:
                raise EOFError("connection closed")
            buf += data
        return buf

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def mapping_pss_kib(pid: int | str = "self", name: str = "/memfd:framewire-decode") -> int:
    """Proportional set size of ``pid``'s mappings of a decode memfd, in KiB."""
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", fields[0]):
            inside = name in line
        elif inside and fields[0] == "Pss:":
            total += int(fields[1])
    return total


def close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
