"""Which way a client's host frames travel: descriptors over the fd socket, else named
POSIX shm segments (docs/api.md, "How frames travel").

The fd handover needs a connection to the worker's fd socket, the same worker that
answers HTTP: frames registered with one worker and an encode sent to another fail.
So every socket is checked against the worker that answered ``/v1/info`` (its
``instance``) before it is used. A socket named by the caller (``fd_socket=``,
FRAMEWIRE_FD_SOCKET: the worker's socket as this process sees it, through a mount)
is tried first, then the path ``/v1/info`` gives; a named socket behind which
another worker answers is passed over, and the log says so (one where nobody
answers yet leaves the frames to named segments until it does); one served by
another user than the worker's is ``worker_not_trusted``. A long-lived client
looks again when the worker that answers HTTP is replaced (a restart), and now
and then after a refusal.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from framewire.client._sharing.fd import FdRegions
from framewire.core.errors import FramewireError, Unavailable
from framewire.core.fdsocket import default_fd_socket
from framewire.core.trust import NOT_TRUSTED

RETRY_S = 10.0  # a socket that was not to be had is tried again after this long

log = logging.getLogger("framewire.client")


class Handover:
    def __init__(
        self,
        fd_socket: str | os.PathLike[str] | None,
        timeout: float | None,
        worker_uid: int | None = None,
    ):
        self.fd_socket = fd_socket
        self.timeout = timeout
        self.worker_uid = worker_uid
        self.named = fd_socket is not None or "FRAMEWIRE_FD_SOCKET" in os.environ
        self._warned: set[str] = set()  # named sockets found to be another worker's
        self.regions: FdRegions | None = None  # host frames go as descriptors through it
        # Not to be had from the worker that answered HTTP (its instance), as of when: a
        # long-lived client tries again once that worker is replaced, or after RETRY_S.
        self._refused: tuple[str | None, float] | None = None

    @property
    def name(self) -> str:
        return "fd" if self.regions is not None and not self.regions.broken else "shm"

    def settled(self, instance: str | None = None) -> bool:
        """Connected, or not to be had from this worker for now: nothing to try before a
        call. ``instance``: the worker that answers HTTP now, when known. May block: it
        is :meth:`refresh`, then :meth:`current`."""
        self.refresh()
        return self.current(instance)

    def stale(self) -> bool:
        """Whether the connection may need making again (:meth:`refresh`), seen without
        waiting: a call looks once, and connects again only when this says so."""
        return self.regions is not None and self.regions.stale()

    def refresh(self) -> None:
        """Make the connection again if the worker closed it (it restarted); blocks. When
        nobody answers there now, it is dropped: the call goes by shm, or falls back."""
        if self.regions is not None:
            try:
                self.regions.refresh()
            except Unavailable:
                self.close()

    def current(self, instance: str | None = None) -> bool:
        """:meth:`settled` of a connection already refreshed (does not block): one that
        reaches another worker than ``instance`` is dropped and looked for again, as the
        first time."""
        if self.regions is not None and instance is not None and self.regions.instance != instance:
            self.close()
        if self._refused is not None:
            was, when = self._refused
            changed = instance is not None and instance != was
            if changed or time.monotonic() - when > RETRY_S:
                self._refused = None
        return self._refused is not None or self.name == "fd"

    def connect(self, info: dict[str, Any]) -> None:
        """Try the fd handover with the worker whose ``/v1/info`` is ``info``."""
        instance = info.get("instance")
        named = str(self.fd_socket or default_fd_socket()) if self.named else None
        told = info.get("sockets", {}).get("fd_socket") or default_fd_socket()
        for path in dict.fromkeys(p for p in (named, told) if p):
            fresh = self._open(path)
            if fresh is None:
                break  # nobody there (yet), or refused: named segments for now
            if fresh.instance != instance:
                fresh.close()  # another worker answers there: not the HTTP one
                if path == named and path not in self._warned:
                    self._warned.add(path)
                    log.warning(
                        "fd socket %s is another worker's (instance %s, not %s): passed over",
                        path,
                        fresh.instance,
                        instance,
                    )
                continue
            self.close()
            self.regions = fresh
            return
        self._refused = (instance, time.monotonic())

    def _open(self, path: str | os.PathLike[str]) -> FdRegions | None:
        try:
            return FdRegions(path, self.timeout, worker_uid=self.worker_uid)
        except FramewireError as exc:  # Unavailable, or refused (not an allowed user)
            if exc.code == NOT_TRUSTED:
                raise  # another user's socket: said, not passed over to named segments
            return None

    def close(self) -> None:
        if self.regions is not None:
            self.regions.close()
            self.regions = None
