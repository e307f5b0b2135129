"""The few facts the live view reads from fragmented MP4: top-level boxes, and of a
``moof``, how many video samples it holds and whether the first is a keyframe.

The video is the first track fragment: the encode maps it first.
"""

from __future__ import annotations

import json
import struct

BOX = struct.Struct(">I4s")
_U32 = struct.Struct(">I")
NON_SYNC = 0x10000  # sample_is_non_sync_sample, in ISO/IEC 14496-12 sample flags


def end_box(reason: str) -> bytes:
    """A ``free`` box that tells a viewer why its stream ended."""
    payload = json.dumps({"framewire": "end", "reason": reason}).encode()
    return BOX.pack(BOX.size + len(payload), b"free") + payload


def boxes(
    data: bytes | bytearray, start: int = 0, end: int | None = None
) -> list[tuple[bytes, int, int]]:
    """(type, start, end) of the whole boxes in ``data[start:end]``."""
    end = len(data) if end is None else end
    out = []
    while start + BOX.size <= end:
        size, kind = BOX.unpack_from(data, start)
        header = BOX.size
        if size == 1:  # a 64-bit size follows
            if start + 16 > end:
                break
            size, header = struct.unpack_from(">Q", data, start + 8)[0], 16
        if size < header or start + size > end:
            break
        out.append((kind, start, start + size))
        start += size
    return out


def _video_traf(moof: bytes) -> dict[bytes, int]:
    """Where the first ``traf``'s ``tfhd`` and ``trun`` start in ``moof``."""
    for kind, a, b in boxes(moof, BOX.size):
        if kind == b"traf":
            return {inner: c for inner, c, _ in boxes(moof, a + BOX.size, b)}
    return {}


def video_samples(moof: bytes) -> int:
    """Samples of the video track fragment in ``moof``."""
    trun = _video_traf(moof).get(b"trun")
    return 0 if trun is None else _U32.unpack_from(moof, trun + 12)[0]


def starts_with_keyframe(moof: bytes) -> bool:
    """Whether the video track fragment in ``moof`` begins with a sync sample: a viewer
    can start there. Unknown (no flags written) counts as no."""
    where = _video_traf(moof)
    tfhd, trun = where.get(b"tfhd"), where.get(b"trun")
    if trun is None:
        return False
    flags = _U32.unpack_from(moof, trun + 8)[0] & 0xFFFFFF
    at = trun + 16 + (4 if flags & 0x1 else 0)  # after sample_count, data_offset
    if flags & 0x4:  # first_sample_flags
        return not _U32.unpack_from(moof, at)[0] & NON_SYNC
    if flags & 0x400:  # per-sample flags: the first entry's, after its duration and size
        at += 4 * bool(flags & 0x100) + 4 * bool(flags & 0x200)
        return not _U32.unpack_from(moof, at)[0] & NON_SYNC
    if tfhd is None:
        return False
    tf = _U32.unpack_from(moof, tfhd + 8)[0] & 0xFFFFFF
    if not tf & 0x20:  # default_sample_flags
        return False
    at = tfhd + 16 + 8 * bool(tf & 0x1) + 4 * bool(tf & 0x2) + 4 * bool(tf & 0x8)
    at += 4 * bool(tf & 0x10)
    return not _U32.unpack_from(moof, at)[0] & NON_SYNC
