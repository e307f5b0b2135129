"""Which files the worker may write and read: everything under configured roots.

Paths are judged after resolving symlinks (``realpath``), so a link inside a
root that points outside it is refused like the outside path itself. ``..``
components are refused before any resolution: no legitimate caller needs them.
"""

from __future__ import annotations

import functools
import os
import stat
from pathlib import Path

from framewire.client.errors import BadRequest, Forbidden, NotFound


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


@functools.lru_cache(maxsize=64)
def _real_root(root: str) -> str:
    # Roots are configuration: resolved once, not on every request.
    return os.path.realpath(root)


def _real_roots(roots: list[str]) -> list[str]:
    return [_real_root(r) for r in roots]


def _no_dotdot(raw: str) -> None:
    if not raw or "\x00" in raw:
        raise BadRequest("empty path or NUL byte in path", code="bad_path")
    if ".." in Path(raw).parts:
        raise Forbidden(f"path {raw!r} contains '..'", code="path_traversal")


def resolve_output(raw: str, roots: list[str], *, create_dirs: bool = True) -> Path:
    """An output path under one of ``roots``; relative paths resolve against the first.

    Missing directories below the root are created (never outside a root).
    """
    _no_dotdot(raw)
    if not roots:
        raise Forbidden("no output roots are configured", code="path_outside_roots")
    path = Path(raw) if os.path.isabs(raw) else Path(roots[0]) / raw
    if path.name in ("", ".", ".."):
        raise BadRequest(f"output path {raw!r} names no file", code="bad_path")
    real_roots = _real_roots(roots)
    parent = os.path.realpath(path.parent)
    if not any(_under(parent, r) for r in real_roots):
        raise Forbidden(
            f"output path {raw!r} is outside the output roots", code="path_outside_roots"
        )
    if create_dirs and not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
        # makedirs follows links that appeared meanwhile; judge the result again
        if not any(_under(os.path.realpath(parent), r) for r in real_roots):
            raise Forbidden(f"output path {raw!r} left the roots", code="path_outside_roots")
    target = Path(parent) / path.name
    try:
        mode = os.lstat(target).st_mode
    except FileNotFoundError:
        return target
    if stat.S_ISLNK(mode):
        raise Forbidden(f"output path {raw!r} is a symbolic link", code="path_outside_roots")
    if not stat.S_ISREG(mode):
        raise BadRequest(f"output path {raw!r} exists and is not a file", code="output_not_a_file")
    return target


def resolve_input(raw: str, roots: list[str]) -> Path:
    """An existing file under one of ``roots`` (relative paths: against the first)."""
    _no_dotdot(raw)
    if not roots:
        raise Forbidden("no input roots are configured", code="path_outside_roots")
    path = Path(raw) if os.path.isabs(raw) else Path(roots[0]) / raw
    real = os.path.realpath(path)
    if not any(_under(real, r) for r in _real_roots(roots)):
        raise Forbidden(f"input path {raw!r} is outside the input roots", code="path_outside_roots")
    if not os.path.isfile(real):
        raise NotFound(f"input file {raw!r} does not exist", code="not_found")
    return Path(real)
