"""Whom a client hands its token, frames and descriptors to: the worker's own user.

A worker's addresses (its TCP port, its socket files) can be taken by another
local user while it is down. So before a client sends anything it checks who is
at the other end: on a Unix socket the peer's uid (``SO_PEERCRED``), on loopback
TCP the uid that owns the worker's end of the connection (core/sockowners.py).
It must be the worker's: ``worker_uid`` (the client's argument), else
``FRAMEWIRE_WORKER_UID``, else the client's own uid; root is always accepted. A
worker on another host cannot be checked this way: a client sends its token
there only over https, or when told to (``FRAMEWIRE_TRUST_REMOTE=1``).

A directory that holds a worker's sockets must be its own too: owned by the
worker's user (or root), and not one where every user may add or rename names.
The worker refuses to start in any other, and a client does not connect there.

A peer that fails a check is :class:`Unavailable` with code
``worker_not_trusted``: nothing was sent to it, and no local fallback hides it.
"""

from __future__ import annotations

import os
import socket
import stat
import time
from collections.abc import Collection
from pathlib import Path

from framewire.core.errors import Unavailable
from framewire.core.sockowners import is_loopback, peercred, tcp_owner

WORKER_UID_ENV = "FRAMEWIRE_WORKER_UID"
TRUST_REMOTE_ENV = "FRAMEWIRE_TRUST_REMOTE"
NOT_TRUSTED = "worker_not_trusted"
# The owner of a fresh loopback connection is listed as soon as it is made; a read of
# /proc/net/tcp (the fallback) can still miss a row that moved under it: asked again.
LOOKUPS, LOOKUP_PAUSE_S = 3, 0.01


def worker_uids(worker_uid: int | None = None) -> frozenset[int]:
    """The uids a worker may run as: ``worker_uid``, else FRAMEWIRE_WORKER_UID, else this
    process's own; and root."""
    if worker_uid is None:
        configured = os.environ.get(WORKER_UID_ENV, "").strip()
        try:
            worker_uid = int(configured) if configured else os.getuid()
        except ValueError:
            raise ValueError(f"{WORKER_UID_ENV}={configured!r} is not a uid") from None
    return frozenset({worker_uid, 0})


def trust_remote() -> bool:
    """Whether FRAMEWIRE_TRUST_REMOTE says a worker on another host may be sent the token
    over plain HTTP."""
    return os.environ.get(TRUST_REMOTE_ENV, "").strip().lower() in ("1", "true", "yes")


def not_trusted(message: str) -> Unavailable:
    return Unavailable(message, code=NOT_TRUSTED)


def unsafe_dir(path: Path, owners: Collection[int]) -> str | None:
    """Why ``path`` may not hold a worker's sockets, or None when it may (or is not
    there). It must be a directory, not a link, owned by one of ``owners``, and not
    writable by every user unless sticky (where none may rename another's names)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory (a link, or another file)"
    if st.st_uid not in owners:
        return f"directory {path} belongs to uid {st.st_uid}, not to uid {_names(owners)}"
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return f"directory {path} is writable by every user (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def check_dir(path: Path, uids: Collection[int]) -> None:
    """Raise ``worker_not_trusted`` unless ``path`` may hold the sockets of a worker of ``uids``."""
    reason = unsafe_dir(path, uids)
    if reason is not None:
        raise not_trusted(f"{reason}: its sockets are not to be trusted")


def check_unix_peer(sock: socket.socket, uids: Collection[int], what: str) -> None:
    """Raise ``worker_not_trusted`` unless the process at the other end of the Unix socket
    ``sock`` (``what``, for the message) runs as one of ``uids``."""
    cred = peercred(sock)
    uid = None if cred is None else cred[1]
    if uid not in uids:
        raise not_trusted(f"{what} is served by uid {uid}, {_not_the_worker(uids)}")


def check_tcp_peer(sock: socket.socket, uids: Collection[int], remote_ok: bool) -> None:
    """Raise ``worker_not_trusted`` unless the loopback port ``sock`` is connected to is
    owned by one of ``uids``; a peer on another host passes only when ``remote_ok``."""
    server, client = sock.getpeername()[:2], sock.getsockname()[:2]
    if not is_loopback(server[0]):
        if remote_ok:
            return
        raise not_trusted(
            f"the worker at {server[0]} port {server[1]} is on another host, where who "
            f"answers cannot be checked: the token goes there only over https, or with "
            f"{TRUST_REMOTE_ENV}=1"
        )
    uid = None
    for attempt in range(LOOKUPS):
        uid = tcp_owner(server, client)  # the worker's end: the listener's owner
        if uid is not None:
            break
        if attempt + 1 < LOOKUPS:
            time.sleep(LOOKUP_PAUSE_S)
    if uid not in uids:
        owner = "an unknown user" if uid is None else f"uid {uid}"
        raise not_trusted(f"port {server[1]} is served by {owner}, {_not_the_worker(uids)}")


def _names(uids: Collection[int]) -> str:
    return " or ".join(str(u) for u in sorted(uids, reverse=True))


def _not_the_worker(uids: Collection[int]) -> str:
    return (
        f"not by the worker's (uid {_names(uids)}): nothing was sent to it "
        f"(set {WORKER_UID_ENV} where the worker runs as another user)"
    )
