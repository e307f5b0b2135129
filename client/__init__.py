"""framewire.client: what an inference process imports to hand videos to the worker."""

from .errors import (
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
    Unavailable,
)
from .http import AsyncClient, Client
from .reference import ReferenceFrames, decode_reference

__version__ = "0.1.0"


def save_videos(videos, paths, *, url: str | None = None, **kw):  # type: ignore[no-untyped-def]
    """One-shot :meth:`Client.save_videos` against ``url`` (default: FRAMEWIRE_URL or local)."""
    import os

    with Client(url or os.environ.get("FRAMEWIRE_URL", "http://127.0.0.1:7700")) as c:
        return c.save_videos(videos, paths, **kw)


def save_video(video, path, *, url: str | None = None, **kw):  # type: ignore[no-untyped-def]
    return save_videos([video], [path], url=url, **kw)[0]


__all__ = [
    "AsyncClient",
    "BadRequest",
    "Cancelled",
    "Client",
    "Conflict",
    "Forbidden",
    "FramewireError",
    "InsufficientStorage",
    "MediaError",
    "NotFound",
    "Overloaded",
    "ReferenceFrames",
    "Stalled",
    "Unavailable",
    "__version__",
    "decode_reference",
    "save_video",
    "save_videos",
]
