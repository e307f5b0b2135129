"""The numba kernels themselves, imported only when they are first wanted (kernels.py).

Module-level functions and constants, not closures: numba keys its on-disk cache on
a hash of a function's closure, and a closure holding another compiled function
hashes differently in every process. Each start would then compile again (about
0.8 s of CPU) and add another entry to the cache, which grows without bound.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

_jit = numba.njit(nogil=True, boundscheck=False, fastmath=False, cache=True)
_LO, _HI, _SCALE = np.float32(0.0), np.float32(255.0), np.float32(255.0)


@_jit
def to_byte(v: Any) -> Any:
    v = v * _SCALE
    v = v if v > _LO else _LO  # NaN compares false: 0
    v = v if v < _HI else _HI
    return np.uint8(v)


@_jit
def rounded_byte(v: Any, low: Any, high: Any, scale: Any) -> Any:
    """vLLM-omni's ``clamp(low, high).sub(low).mul(scale).round()`` then the cast, each
    step in float32 as torch takes it (its scalars cast to float32 first): no fused
    multiply-add, ``rint`` rounds half to even as ``round`` does."""
    if v != v:
        return np.uint8(0)  # NaN: what torch's cast gives it on x86 (the tests compare)
    v = v if v > low else low
    v = v if v < high else high
    return np.uint8(np.rint((v - low) * scale))


@_jit
def byte(v: Any, terms: Any) -> Any:
    """``to_byte``, or ``rounded_byte`` with ``terms`` (low, high, scale) when they are
    given (a low below the high): the branch does not change within a kernel's call,
    so the compiler takes it outside the loop and vectorizes each."""
    if terms[0] < terms[1]:
        return rounded_byte(v, terms[0], terms[1], terms[2])
    return to_byte(v)


@_jit
def planar(src: Any, plane: int, frame: int, row: int, shape: Any, dst: Any, terms: Any) -> None:
    """``shape`` (t, r, w) frames from planes ``plane`` elements apart in flat ``src``
    (each row contiguous, ``row`` and ``frame`` apart) into flat (t, r, w, 3) ``dst``,
    each value as ``byte`` with ``terms`` (kernels.STANDARD: section 3's conversion).

    Flat, unit-stride arrays: with them the compiler knows the rows are contiguous
    and vectorizes the loop (on strided 4-D arrays it cannot)."""
    frames, rows, width = shape
    for t in range(frames):
        for y in range(rows):
            s = t * frame + y * row
            d = ((t * rows) + y) * width * 3
            # Row views indexed from 0: indices the compiler knows are not negative
            # (no wraparound check), so the loop vectorizes.
            p0, p1, p2 = src[s : s + width], src[s + plane :], src[s + 2 * plane :]
            out = dst[d : d + 3 * width]
            for x in range(width):
                out[3 * x] = byte(p0[x], terms)
                out[3 * x + 1] = byte(p1[x], terms)
                out[3 * x + 2] = byte(p2[x], terms)


@_jit
def interleaved(src: Any, dst: Any, terms: Any) -> None:
    """Flat float32 ``src`` into flat uint8 ``dst`` of the same size, each value as
    ``byte`` with ``terms``."""
    for i in range(src.size):
        dst[i] = byte(src[i], terms)
