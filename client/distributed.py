"""Reference decodes for the ranks of a ``torch.distributed`` group.

Every rank tries the worker of its host, falls back to a local decode, and then
all ranks exchange one small status each in a single ``all_gather_object``.
Either every rank returns its frames or every rank raises the same error: no
rank can go on to a collective that another rank skipped.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from framewire.client._http import Client
from framewire.core.errors import FramewireError, error_class, rebuild
from framewire.core.reference import ReferenceFrames, fetch, make_request

# Errors are rebuilt from their class name, limited to framewire's hierarchy: only
# plain strings travel between ranks, never an exception object.
_MESSAGE_LIMIT = 2000
_DETAIL_LIMIT = 4096


def _status(exc: BaseException | None, rank: int) -> dict[str, Any]:
    status: dict[str, Any] = {"ok": exc is None, "rank": rank, "host": socket.gethostname()}
    if exc is None:
        return status
    if isinstance(exc, FramewireError):
        name, code, message, detail = type(exc).__name__, exc.code, exc.message, exc.detail
    else:
        name, code, message, detail = "FramewireError", "internal", repr(exc), None
    status |= {
        "error": error_class(name=name).__name__,
        "code": code,
        "message": message[:_MESSAGE_LIMIT],
        "detail": detail[-_DETAIL_LIMIT:] if detail else None,
    }
    return status


def _error(statuses: list[dict[str, Any]]) -> FramewireError:
    """The one error every rank raises: the first failing rank's, naming it."""
    failed = [s for s in statuses if not s["ok"]]
    first = failed[0]
    others = f" ({len(failed)} of {len(statuses)} ranks failed)" if len(failed) > 1 else ""
    message = (
        f"reference decode failed on rank {first['rank']} (host {first['host']}){others}: "
        f"{first['message']}"
    )
    cls = error_class(name=first["error"])
    return rebuild(cls, message, code=first["code"], detail=first["detail"])


def decode_reference_shared(
    path: str | os.PathLike[str],
    *,
    fps: float,
    width: int,
    height: int,
    start: float = 0.0,
    max_frames: int | None = None,
    group: Any = None,
    client: Client | None = None,
    decoder: str | None = None,
    local_fallback: bool = True,
) -> ReferenceFrames:
    """Every rank of ``group`` (default: the world) gets the frames, or every rank raises.

    Each rank asks its host's worker (``client``'s fd socket, else the default
    one) and decodes locally when the worker cannot be reached (unless
    ``local_fallback=False``; ``decoder``: the ffmpeg identity asked for). All ranks must
    call this together: it always runs exactly one ``all_gather_object``.
    Without an initialized process group it is a plain :func:`decode_reference`.
    """
    import torch.distributed as dist

    def one_rank() -> ReferenceFrames:
        request = make_request(
            path,
            fps=fps,
            width=width,
            height=height,
            start=start,
            max_frames=max_frames,
            decoder=decoder,
        )
        if client is not None:
            return client._fetch(request, local_fallback)  # its fd socket, its worker's user
        return fetch(request, local_fallback=local_fallback)

    if not (dist.is_available() and dist.is_initialized()):
        return one_rank()

    frames: ReferenceFrames | None = None
    failure: Exception | None = None
    try:
        frames = one_rank()
    except Exception as exc:  # every failure must reach the collective, not skip it
        failure = exc
    statuses: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(statuses, _status(failure, dist.get_rank()), group=group)
    except BaseException:
        if frames is not None:
            frames.close()
        raise
    if all(s["ok"] for s in statuses):
        assert frames is not None
        return frames
    if frames is not None:
        frames.close()
    raise _error(statuses) from failure
