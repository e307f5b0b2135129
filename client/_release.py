"""CUDA shares whose call ended without the worker's answer, released only once the
worker has let go of them (``POST /v1/cuda/shares/{id}/release``).

Until then the producer's memory stays out of reuse: freeing memory another process
has mapped, while it may still read it, is undefined in CUDA. Each such share is handled
on a thread of its own (a rare event: a cancel, a timeout, a lost connection), over a
connection of its own, so the caller goes on at once. The worker answers once it holds
the share no more, and refuses it from then on; a socket nothing has listened on for
:data:`GIVE_UP_S` is a worker gone, and its mappings with it. A worker that keeps
answering "not yet" (a stalled conversion), or one too old to know the route, keeps the
memory held, with one warning: held memory is a leak until the process exits, reused
memory would be corruption.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from framewire.client._sharing.cuda import CudaShare

log = logging.getLogger("framewire.client")

WAIT_S = 30.0  # each request's wait on the worker's side
GIVE_UP_S = 300.0  # in all: longer than a drain's grace (FRAMEWIRE_SHUTDOWN_GRACE, 30 s)
RETRY_S = 1.0  # between connection attempts while nothing listens


class DeferredReleases:
    """Releases shares once the worker lets go of them, over connections ``connect``
    makes."""

    def __init__(self, connect: Callable[[], httpx.Client]):
        self.connect = connect
        self.threads: list[threading.Thread] = []  # those under way (tests wait for them)

    def __call__(self, share: CudaShare) -> None:
        thread = threading.Thread(
            target=self._release, args=(share,), name="framewire-release", daemon=True
        )
        self.threads = [t for t in self.threads if t.is_alive()] + [thread]
        thread.start()

    def _release(self, share: CudaShare) -> None:
        try:
            if self._let_go(share.share_id):
                share.release()
                return
        except Exception as exc:
            log.warning(
                "could not have the worker let go of CUDA share %s: %s", share.share_id, exc
            )
        log.warning(
            "kept the GPU memory of CUDA share %s out of reuse: its call ended without an "
            "answer and the worker did not confirm it stopped reading it",
            share.share_id,
        )

    def _let_go(self, share_id: str) -> bool:
        """Asked until the worker answers released (True), refuses, or GIVE_UP_S has
        passed; a socket nobody listened on all that time is a worker gone (True): a
        draining one refuses connections too, but only for its grace period, and then
        stops what still reads."""
        path = f"/v1/cuda/shares/{share_id}/release"
        deadline = time.monotonic() + GIVE_UP_S
        listened = False
        with self.connect() as http:
            while time.monotonic() < deadline:
                try:
                    r = http.post(path, params={"wait_s": WAIT_S}, timeout=WAIT_S + 10)
                except httpx.ConnectError:
                    time.sleep(RETRY_S)
                    continue
                except httpx.TransportError:
                    listened = True
                    continue  # lost on the way: ask again
                listened = True
                if r.status_code != 200:
                    return False  # a worker without the route, or one that refuses it
                if r.json().get("released") is True:
                    return True
        return not listened
