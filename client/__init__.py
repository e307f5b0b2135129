"""framewire.client: what an inference process imports to hand videos to the worker.

The names below are the public surface; everything in a module whose name
starts with an underscore is private. ``framewire.client.wire`` (the request
and response models) and ``framewire.client.distributed`` are public modules.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from framewire.client._http import AsyncClient, Client
from framewire.client._version import __version__
from framewire.client._writers import AsyncVideoWriter, VideoWriter
from framewire.core.errors import (
    BadRequest,
    Cancelled,
    Conflict,
    Forbidden,
    FramewireError,
    InsufficientStorage,
    MediaError,
    NotFound,
    Overloaded,
    Stalled,
    StoreError,
    Unauthorized,
    Unavailable,
)
from framewire.core.media.identity import ffmpeg_identity, pyav_identity
from framewire.core.reference import ReferenceFrames, decode_reference
from framewire.core.wire import Layout, MediaInfo, OutputResult


def save_videos(
    videos: Sequence[Any],
    paths: Sequence[str | os.PathLike[str]],
    *,
    url: str | None = None,
    **kw: Any,
) -> list[OutputResult]:
    """One-shot :meth:`Client.save_videos` against ``url`` (default: FRAMEWIRE_URL, else
    the worker's default address)."""
    with Client(url) as client:
        return client.save_videos(videos, paths, **kw)


def save_video(
    video: Any, path: str | os.PathLike[str], *, url: str | None = None, **kw: Any
) -> OutputResult:
    """One-shot :meth:`Client.save_video`."""
    return save_videos([video], [path], url=url, **kw)[0]


__all__ = [
    "AsyncClient",
    "AsyncVideoWriter",
    "BadRequest",
    "Cancelled",
    "Client",
    "Conflict",
    "Forbidden",
    "FramewireError",
    "InsufficientStorage",
    "Layout",
    "MediaError",
    "MediaInfo",
    "NotFound",
    "OutputResult",
    "Overloaded",
    "ReferenceFrames",
    "Stalled",
    "StoreError",
    "Unauthorized",
    "Unavailable",
    "VideoWriter",
    "__version__",
    "decode_reference",
    "ffmpeg_identity",
    "pyav_identity",
    "save_video",
    "save_videos",
]
