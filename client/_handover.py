"""Which way a client's host frames travel: descriptors over the fd socket, else named
POSIX shm segments (docs/api.md, "How frames travel").

The fd handover needs a connection to the worker's fd socket, the same worker that
answers HTTP. A socket named by the caller (``fd_socket=``, FRAMEWIRE_FD_SOCKET)
is taken to be that worker's, and tried again on every call until it answers.
Otherwise the path ``/v1/info`` gives is tried, and used only if the worker
behind it is the one that answered ``/v1/info`` (its ``instance``); a long-lived
client looks again when the worker that answers HTTP is replaced (a restart), and
now and then after a refusal.
"""

from __future__ import annotations

import os
import time
from typing import Any

from framewire.client._sharing.fd import FdRegions
from framewire.core.errors import FramewireError, Unavailable
from framewire.core.fdsocket import default_fd_socket

RETRY_S = 10.0  # a socket that was not to be had is tried again after this long


class Handover:
    def __init__(self, fd_socket: str | os.PathLike[str] | None, timeout: float | None):
        self.fd_socket = fd_socket
        self.timeout = timeout
        self.named = fd_socket is not None or "FRAMEWIRE_FD_SOCKET" in os.environ
        self.regions: FdRegions | None = None  # host frames go as descriptors through it
        # Not to be had from the worker that answered HTTP (its instance), as of when: a
        # long-lived client tries again once that worker is replaced, or after RETRY_S.
        self._refused: tuple[str | None, float] | None = None

    @property
    def name(self) -> str:
        return "fd" if self.regions is not None and not self.regions.broken else "shm"

    def settled(self, instance: str | None = None) -> bool:
        """Connected, or not to be had from this worker for now: nothing to try before a
        call. ``instance``: the worker that answers HTTP now, when known.

        A connection the worker closed (it restarted) is made again here, before the
        call uses it; one that now reaches another worker than ``instance`` is dropped
        and looked for again, as the first time."""
        if self.regions is not None:
            try:
                self.regions.refresh()
            except Unavailable:
                self.close()  # nobody there now: the call goes by shm, or falls back
            else:
                moved = instance is not None and self.regions.instance != instance
                if moved and not self.named:
                    self.close()
        if self._refused is not None:
            was, when = self._refused
            changed = instance is not None and instance != was
            if changed or time.monotonic() - when > RETRY_S:
                self._refused = None
        return self._refused is not None or self.name == "fd"

    def wants_info(self) -> bool:
        """Whether :meth:`connect` needs ``/v1/info`` (the socket was not named)."""
        return not self.named

    def connect(self, info: dict[str, Any] | None) -> None:
        """Try the fd handover (``info``: ``/v1/info``, when :meth:`wants_info`)."""
        path = self.fd_socket or default_fd_socket()
        instance = None if info is None else info.get("instance")
        if info is not None:
            path = info.get("sockets", {}).get("fd_socket") or path
        try:
            fresh = FdRegions(path, self.timeout)
        except Unavailable:  # no worker there (yet): a named socket is tried again
            if info is not None:
                self._refused = (instance, time.monotonic())
            return
        except FramewireError:  # refused (not an allowed user)
            self._refused = (instance, time.monotonic())
            return
        if info is not None and fresh.instance != instance:
            fresh.close()  # another worker answers there: not the HTTP one
            self._refused = (instance, time.monotonic())
            return
        self.close()
        self.regions = fresh

    def close(self) -> None:
        if self.regions is not None:
            self.regions.close()
            self.regions = None
