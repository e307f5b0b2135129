"""The reference decode scales with ``bicubic`` instead of the contract's ``lanczos``, in
the worker and in the local fallback: the decode tests, whose oracle is the contract's
command written out, must fail."""

from __future__ import annotations

from typing import Any


def apply() -> None:
    from framewire.core import decode
    from framewire.core.media import argv

    original = argv.decode_argv

    def bicubic(*args: Any, **kw: Any) -> list[str]:
        return [a.replace("flags=lanczos", "flags=bicubic") for a in original(*args, **kw)]

    argv.decode_argv = bicubic
    decode.decode_argv = bicubic  # type: ignore[attr-defined]
