"""The encoder a client runs in its own process when no worker answers: a seam.

A client must write the file its engine would have written even with no worker
to reach, with the worker's bytes, so it needs the worker's encoder; but that
encoder is the service's (its conversion, its children, torch), which the
client may not import, and an inference process without the service's extra
still imports the client. So the core says what such an encoder does
(:class:`LocalEncoding`) and finds one through the ``framewire.local_encoder``
entry-point group, which the service fills (pyproject.toml). Nothing here
names a module of a layer above.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, Protocol

from framewire.core.frames import Frames
from framewire.core.wire import OutputResult

GROUP = "framewire.local_encoder"


class LocalStream(Protocol):
    """One output fed chunk by chunk in this process."""

    def write(self, frames: Frames) -> None: ...
    def finish(self) -> OutputResult: ...
    def abort(self) -> None: ...


class LocalEncoding(Protocol):
    """Saves and streams in this process, with the worker's bytes. ``fields``: a save's
    keywords (fps, quality, preset, threads, audio, audio_sample_rate, profile,
    value_range, presign_s, validate, encoder; a stream's also live)."""

    def save(
        self, video: Any, path: str | os.PathLike[str], fields: dict[str, Any], layout: Any = None
    ) -> OutputResult: ...

    def open(
        self, path: str | os.PathLike[str], fields: dict[str, Any], first: Frames
    ) -> LocalStream: ...

    def close(self) -> None:
        """Let go of what it keeps between encodes (binaries held open, writers ahead)."""


def local_encoder(output_root: str | os.PathLike[str] | None) -> LocalEncoding:
    """The installed provider's encoder (relative paths under ``output_root``).

    Raises :class:`ImportError` when none is installed, or when the provider's own
    requirements are missing (the service's extra)."""
    found = sorted(entry_points(group=GROUP), key=lambda point: point.name)
    if not found:
        raise ImportError(f"no {GROUP!r} entry point is installed")
    make: Callable[[str | os.PathLike[str] | None], LocalEncoding] = found[0].load()
    return make(output_root)
