"""Compiled float32 -> rgb24 kernels: each source value read once, each byte written once.

The standard conversion ``(x * 255).clamp(0, 255).to(torch.uint8)`` then a
permute to (T, H, W, 3) takes four passes over a block on the pure kernel
(scale, clamp, cast, interleave). These kernels do it in one, in the same
float32 arithmetic: one multiply by 255.0f (exact IEEE single precision, no
fused operations), a clamp written as two comparisons, a truncating cast.
``fastmath`` stays off: it would let the compiler assume there is no NaN.

NaN is the one value whose bytes are not fixed by the formula: ``clamp``
keeps it, and the cast of NaN to uint8 is left to the platform (x86 gives 0,
for torch's kernels and these alike). The kernel maps it to 0 outright;
tests/service/encode/test_convert.py compares every value class (NaN, infinities,
signed zeros, values a rounding step off each integer) with the pure kernel on
the machine that runs them, and the byte-exactness tests run with both.

numba compiles them (``jitted.py``) on first use (``cache=True``: later processes
load the machine code from ``__pycache__``, or ``NUMBA_CACHE_DIR``); without numba, or
with ``FRAMEWIRE_KERNEL=pure``, the pure kernel runs with the same bytes.
float16 and bfloat16 always take the pure kernel: their arithmetic rounds to
the narrow type after the multiply, which the kernels do not model.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from typing import Any, Literal

import numpy as np

log = logging.getLogger("framewire.kernels")

Mode = Literal["auto", "compiled", "pure"]

# jitted.byte's terms for the standard conversion (a low not below the high); the
# vllm-omni profile's are its (low, high, scale), the same types: one compiled kernel.
STANDARD = (np.float32(0.0), np.float32(0.0), np.float32(0.0))
Terms = tuple[np.float32, np.float32, np.float32]

_lock = threading.Lock()
_mode: Mode = "auto"
_kernels: tuple[Any, Any] | None = None
_failed = False


def use(mode: Mode) -> None:
    """``auto``: the kernels when numba imports; ``compiled``: the kernels or an error at
    first use; ``pure``: never (the worker's FRAMEWIRE_KERNEL)."""
    global _mode, _failed
    _mode, _failed = mode, False


def active() -> str:
    """Which kernel float32 takes: ``compiled`` or ``pure`` (for /v1/info; compiles nothing)."""
    if _mode == "pure" or _failed:
        return "pure"
    return "compiled" if importlib.util.find_spec("numba") is not None else "pure"


def kernels() -> tuple[Any, Any] | None:
    """(planar, interleaved) compiled kernels, or None for the pure kernel."""
    global _kernels, _failed
    if _mode == "pure" or _failed:
        return None
    if _kernels is None:
        with _lock:
            if _kernels is None and not _failed:
                try:
                    _kernels = _compile()
                except ImportError as exc:
                    if _mode == "compiled":
                        raise
                    _failed = True
                    log.info("numba is not installed (%s): float32 takes the pure kernel", exc)
    return _kernels


def warm() -> None:
    """Compile (or load from the cache) both kernels now, on a tiny block: the first
    encode then pays neither the time nor the memory (numba's compiler, ~130 MiB
    resident, measured) inside its own window. The worker does this as it starts."""
    try:
        found = kernels()
    except ImportError:
        return  # FRAMEWIRE_KERNEL=compiled without numba: the first encode says so
    if found is None:
        return
    planar, interleaved = found
    src, dst = np.zeros(3 * 4, np.float32), np.zeros(3 * 4, np.uint8)
    planar(src, 4, 4, 2, (1, 2, 2), dst, STANDARD)
    interleaved(src, dst, STANDARD)  # the profile's terms: the same types, this signature


def _compile() -> tuple[Any, Any]:
    from framewire.service._convert import jitted  # imports numba: only when wanted

    return jitted.planar, jitted.interleaved
