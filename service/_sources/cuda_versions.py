"""Whether this worker's torch can open a producer's IPC handle, decided from its bytes
before any CUDA call: producers run whatever torch their engine pins.

torch's handle to a storage (``c10::cuda::CUDACachingAllocator::shareIpcHandle``) is a
format version byte, a type byte (``c``: a plain ``cudaMalloc`` block, followed by
CUDA's 64-byte ``cudaIpcMemHandle_t``; ``e``: an expandable segment, whose payload
names file descriptors the importer takes with ``pidfd_getfd``), then the payload. The
importer refuses a version newer than its own ("from a future version of torch"). torch
2.13 raised the version from 2 to 3 without changing the ``c`` payload, so a ``c``
handle of version 3 opens on an older torch with its version byte put back to 2; an
``e`` handle is opened only by a torch that knows its version. A bare 64-byte handle is
CUDA's own (a Triton client's, or an old torch's), opened as it is.
"""

from __future__ import annotations

import torch
from framewire.core.errors import Conflict
from framewire.core.wire import IPC_HANDLE_BYTES

MALLOC, EXPANDABLE = b"c", b"e"
SAME_MALLOC_PAYLOAD = (2, 3)  # versions whose "c" payload is the same bytes


def handle_version(torch_version: str) -> int:
    """The handle format version a torch writes and reads (read from torch's sources)."""
    major, minor = (int(part) for part in torch_version.split("+")[0].split(".")[:2])
    return 3 if (major, minor) >= (2, 13) else 2


def importable(handle: bytes, producer: str | None, ours: str = torch.__version__) -> bytes:
    """``handle`` as this torch opens it, or 409 ``cuda_torch_mismatch`` naming both."""
    if len(handle) == IPC_HANDLE_BYTES or len(handle) < 2:
        return handle  # CUDA's own; the open judges anything shorter
    version, kind, own = handle[0], handle[1:2], handle_version(ours)
    if version <= own:
        return handle
    if kind == MALLOC and {version, own} <= set(SAME_MALLOC_PAYLOAD):
        return bytes([own]) + handle[1:]
    what = "an expandable segment's" if kind == EXPANDABLE else f"a {kind!r}"
    raise Conflict(
        f"the producer's torch ({producer or 'unknown version'}) wrote {what} IPC handle "
        f"of format {version}; this worker's torch {ours} reads format {own} at most: run "
        "the worker with a torch at least as new as the producers' (FRAMEWIRE_TORCH)",
        code="cuda_torch_mismatch",
    )
