"""Putting a caller's frames where the worker can read them, and describing them.

:func:`share` picks the way: CUDA tensors go through CUDA IPC (``cuda``), host
memory through POSIX shared memory (``shm``). Nothing is pickled: the worker
gets a JSON descriptor.
"""

from __future__ import annotations

import contextlib
from typing import Any

from framewire.client._sharing.shm import shared
from framewire.client._sharing.video import is_cuda
from framewire.client.wire import CudaIpcSource, Layout, ShmSource


def share(
    video: Any, *, layout: Layout | str | None = None
) -> contextlib.AbstractContextManager[ShmSource | CudaIpcSource]:
    """A context manager yielding the descriptor the worker reads ``video`` through.

    Call it on the thread that produced a CUDA tensor (that thread's stream is the one
    waited for); entering it may happen on another.
    """
    if is_cuda(video):
        from framewire.client._sharing.cuda import CudaShare  # imports torch

        return CudaShare(video, layout=layout)
    return shared(video, layout=layout)
