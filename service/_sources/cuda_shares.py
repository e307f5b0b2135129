"""Which producers' CUDA shares the worker holds open, and which it has let go of for
good: what lets a producer release its memory only once the worker has stopped reading.

A producer keeps a shared tensor's memory out of reuse until it releases torch's IPC
counter. When its call ends with the worker's answer, the worker has closed what it
opened, and the producer releases at once. When the call ends without one (cancelled,
timed out, the connection lost), the worker may still be converting a chunk of it, or
may not have read the request yet; the producer then names the share
(``CudaIpcSource.share_id``) in ``POST /v1/cuda/shares/{id}/release``
(service/_http/videos.py) and releases its counter only once that answers ``released``:
the share is not open here, and from then on a request naming it is refused (409
``cuda_share_released``) before its handle is touched. Released ids are kept for
:data:`RELEASED_S`, at most :data:`MAX_RELEASED` of them: a request older than that was
never going to be read.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict

from framewire.core.errors import Conflict

RELEASED_S = 600.0
MAX_RELEASED = 65536


class Shares:
    """The shares open now (by id, counted), and those let go of for good."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: Counter[str] = Counter()
        self._released: OrderedDict[str, float] = OrderedDict()

    def opening(self, share_id: str | None) -> None:
        """About to open ``share_id``'s handle: refused if it was released."""
        if share_id is None:
            return
        with self._lock:
            self._forget_old()
            if share_id in self._released:
                raise Conflict(
                    f"the CUDA share {share_id} was released: its producer was told the "
                    "worker would not read it, and may have freed it",
                    code="cuda_share_released",
                )
            self._open[share_id] += 1

    def closed(self, share_id: str | None) -> None:
        """What was opened of ``share_id`` is closed (its mapping dropped)."""
        if share_id is None:
            return
        with self._lock:
            self._open[share_id] -= 1
            if self._open[share_id] <= 0:
                del self._open[share_id]

    def release(self, share_id: str) -> bool:
        """True, and ``share_id`` never opened from now on, unless it is open now."""
        with self._lock:
            if self._open.get(share_id):
                return False
            self._released[share_id] = time.monotonic()
            self._released.move_to_end(share_id)
            self._forget_old()
            return True

    def _forget_old(self) -> None:
        horizon = time.monotonic() - RELEASED_S
        while self._released and (
            len(self._released) > MAX_RELEASED or next(iter(self._released.values())) < horizon
        ):
            self._released.popitem(last=False)
