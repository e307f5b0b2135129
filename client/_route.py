"""Which way a client's host frames travel: descriptors over the fd socket, else named
POSIX shm segments (docs/api.md, "How frames travel").

The fd route needs a connection to the worker's fd socket, the same worker that
answers HTTP. A socket named by the caller (``fd_socket=``, FRAMEWIRE_FD_SOCKET)
is taken to be that worker's, and tried again on every call until it answers.
Otherwise the path ``/v1/info`` gives is tried once, and used only if the worker
behind it is the one that answered ``/v1/info`` (its ``instance``).
"""

from __future__ import annotations

import os
from typing import Any

from framewire.client._errors import FramewireError, Unavailable
from framewire.client._fdsocket import default_fd_socket
from framewire.client._sharing.fd import FdRegions


class HostRoute:
    def __init__(self, fd_socket: str | os.PathLike[str] | None, timeout: float | None):
        self.fd_socket = fd_socket
        self.timeout = timeout
        self.named = fd_socket is not None or "FRAMEWIRE_FD_SOCKET" in os.environ
        self.regions: FdRegions | None = None  # host frames go as descriptors through it
        self._refused = False  # another worker's socket, or not ours to use

    @property
    def name(self) -> str:
        return "fd" if self.regions is not None and not self.regions.broken else "shm"

    def settled(self) -> bool:
        """Connected, or not to be had from this worker: nothing to try before a call."""
        return self._refused or self.name == "fd"

    def wants_info(self) -> bool:
        """Whether :meth:`connect` needs ``/v1/info`` (the socket was not named)."""
        return not self.named

    def connect(self, info: dict[str, Any] | None) -> None:
        """Try the fd route (``info``: ``/v1/info``, when :meth:`wants_info`)."""
        path = self.fd_socket or default_fd_socket()
        if info is not None:
            path = info.get("sockets", {}).get("fd_socket") or path
        try:
            fresh = FdRegions(path, self.timeout)
        except Unavailable:  # no worker there (yet): a named socket is tried again
            self._refused = info is not None
            return
        except FramewireError:  # refused (not an allowed user): it will stay so
            self._refused = True
            return
        if info is not None and fresh.instance != info.get("instance"):
            fresh.close()  # another worker answers there: not the HTTP one
            self._refused = True
            return
        self.close()
        self.regions = fresh

    def close(self) -> None:
        if self.regions is not None:
            self.regions.close()
            self.regions = None
