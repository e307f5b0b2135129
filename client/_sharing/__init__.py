"""Putting a caller's frames where the worker can read them, and describing them.

:func:`share` picks the way: CUDA tensors go through CUDA IPC (``cuda``); host
memory as a descriptor over the worker's fd socket when the client has a
connection to it (``fd``), else through a named POSIX shm segment (``shm``).
Nothing is pickled: the worker gets a JSON descriptor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from framewire.client._sharing.fd import FdRegions, fd_shared
from framewire.core.frames import is_cuda
from framewire.core.shm import shared
from framewire.core.wire import CudaIpcSource, Layout, RegionSource, ShmSource


def share(
    video: Any,
    *,
    layout: Layout | str | None = None,
    regions: FdRegions | None = None,
    release_later: Callable[[Any], None] | None = None,
) -> contextlib.AbstractContextManager[ShmSource | RegionSource | CudaIpcSource]:
    """A context manager yielding the descriptor the worker reads ``video`` through.

    Call it on the thread that produced a CUDA tensor (that thread's stream is the one
    waited for); entering it may happen on another. ``release_later`` takes a CUDA share
    whose call ended without the worker's answer (client/_release.py).
    """
    if is_cuda(video):
        from framewire.client._sharing.cuda import CudaShare  # imports torch

        return CudaShare(video, layout=layout, release_later=release_later)
    if regions is not None:
        return fd_shared(video, regions, layout=layout)
    return shared(video, layout=layout)
