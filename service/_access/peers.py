"""Who is asking, and may they themselves read (or write) what they ask the worker to.

The worker may run as a user (or root) who can read more than its callers. A
caller that names a segment, a region, a reference video or an audio file must
not get through the worker what it could not read itself: that is a confused
deputy. So every file the worker opens on a request's behalf is judged against
the *caller's* credentials with the usual owner/group/other mode bits (ACLs and
capabilities other than root's are not consulted).

Callers are known on both HTTP listeners and the fd socket:

- Unix sockets: ``SO_PEERCRED`` (pid, uid, gid), plus the supplementary groups
  from ``/proc/<pid>/status`` when that process is visible here.
- TCP over loopback: the kernel's table of the host's sockets names the uid
  that owns the client's end, as identd does (core/sockowners.py). Only loopback
  peers are looked up: anything else may be a proxy or another host.
- Anyone else is unknown: without a bearer token configured, an unknown caller
  may not have the worker read host memory or files for it.
"""

from __future__ import annotations

import os
import pwd
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from framewire.core.errors import Conflict, Forbidden
from framewire.core.sockowners import peercred, tcp_owner

READ, WRITE, SEARCH = 4, 2, 1  # the rwx bits, as the owner/group/other triplets spell them


@dataclass(frozen=True)
class Peer:
    """A caller's credentials. ``pid`` is None when only the uid is known (TCP); ``gid``
    is its primary group (-1 where the uid has no entry in the user database)."""

    uid: int
    gids: frozenset[int]
    pid: int | None = None
    gid: int = -1

    def may(self, st: os.stat_result, want: int) -> bool:
        """Whether this caller has ``want`` (READ, WRITE, SEARCH bits) on a file like ``st``."""
        if self.uid == 0:
            return True
        mode = stat.S_IMODE(st.st_mode)
        if self.uid == st.st_uid:
            bits = mode >> 6
        elif st.st_gid in self.gids:
            bits = mode >> 3
        else:
            bits = mode
        return bits & want == want


def _supplementary_groups(pid: int) -> set[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def _groups_of(uid: int) -> tuple[int, set[int]]:
    """The primary group of ``uid`` (-1: unknown) and all of its groups."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return -1, set()
    return entry.pw_gid, set(os.getgrouplist(entry.pw_name, entry.pw_gid))


def unix_peer(sock: socket.socket) -> Peer | None:
    """The credentials of the process at the other end of a Unix stream socket."""
    cred = peercred(sock)
    if cred is None:
        return None
    pid, uid, gid = cred
    groups = {gid} | (_supplementary_groups(pid) if pid > 0 else set())
    return Peer(uid, frozenset(groups), pid if pid > 0 else None, gid)


def tcp_peer(client: tuple[str, int], server: tuple[str, int]) -> Peer | None:
    """The owner of the loopback TCP socket at ``client`` connected to ``server``."""
    uid = tcp_owner(client, server)
    if uid is None:
        return None
    gid, groups = _groups_of(uid)
    return Peer(uid, frozenset(groups), gid=gid)


def allowed(peer: Peer | None, uids: list[int], gids: list[int]) -> bool:
    """Whether ``peer`` is one of the users the worker serves as ranks
    (FRAMEWIRE_ALLOWED_UIDS, FRAMEWIRE_ALLOWED_GIDS)."""
    if peer is None:
        return False
    return peer.uid in uids or any(g in gids for g in peer.gids)


def may_reach(
    peer: Peer, path: Path, root: Path, want: int, target: os.stat_result | None = None
) -> bool:
    """``want`` on ``path`` itself (``target``: its stat, if already taken from an open
    fd), and search permission on each directory from ``root`` down to it."""
    try:
        relative = path.relative_to(root)
    except ValueError:
        return False
    if peer.uid == 0:
        return True  # root may do anything: nothing to look up (and nothing to race)
    at = root
    try:
        for part in relative.parts:
            if not peer.may(os.stat(at), SEARCH):
                return False
            at = at / part
        return peer.may(target if target is not None else os.stat(path), want)
    except (FileNotFoundError, NotADirectoryError) as exc:
        # A directory on the way replaced while it was judged: a race, not a refusal.
        raise Conflict(f"{path} changed while it was being judged", code="path_changed") from exc
    except OSError:
        return False


class Access:
    """What one request may have the worker read and write for it.

    ``peer`` None: the caller is unknown (not over a Unix socket or loopback TCP).
    Then only a caller who presented the bearer token (``trusted``) is let through,
    judged as the worker itself.
    """

    def __init__(self, peer: Peer | None, trusted: bool):
        self.peer = peer
        self.trusted = trusted

    def check(self, st: os.stat_result, want: int, what: str) -> None:
        """Raise Forbidden unless the caller has ``want`` on a file like ``st``."""
        self._known(what)
        if self.peer is not None and not self.peer.may(st, want):
            raise Forbidden(_denied(self.peer, what, want), code="caller_not_permitted")

    @property
    def admin(self) -> bool:
        """Root, the worker's own uid (which could read the worker's memory anyway), or an
        unidentified token holder: who may see and use every caller's regions."""
        if self.peer is None:
            return self.trusted
        return self.peer.uid in (0, os.getuid())

    def owns(self, uid: int | None) -> bool:
        """Whether the caller may act on what uid ``uid`` registered (None: registered
        by an unidentified token holder, the worker's own)."""
        if self.admin:
            return True
        return self.peer is not None and uid is not None and self.peer.uid == uid

    @property
    def share_key(self) -> int | None:
        """Whose share of the worker's queues and budgets this caller takes: its uid;
        None (not limited) for an admin, or a caller no uid describes."""
        if self.admin or self.peer is None:
            return None
        return self.peer.uid

    def owner(self, what: str) -> int | None:
        """Whose what this caller registers or opens (``what``) is: its uid; None for an
        unidentified token holder. An unidentified caller without the token is refused."""
        self._known(what)
        return None if self.peer is None else self.peer.uid

    def check_owner(self, uid: int | None, what: str) -> None:
        """Raise Forbidden unless the caller :meth:`owns` what ``uid`` registered or handed
        over: memory no mode bits describe, or a name another user claimed."""
        self._known(what)
        if not self.owns(uid):
            owner = "the worker" if uid is None else f"uid {uid}"
            caller = "unknown" if self.peer is None else f"uid {self.peer.uid}"
            raise Forbidden(
                f"{what} belongs to {owner}; the caller is {caller}",
                code="caller_not_permitted",
            )

    def check_path(
        self,
        path: Path,
        roots: list[str],
        want: int,
        what: str,
        target: os.stat_result | None = None,
    ) -> None:
        """``check`` for a file under one of ``roots``, its directories included."""
        self._known(what)
        if self.peer is None:
            return
        root = next((Path(r) for r in roots if path.is_relative_to(r)), None)
        if root is None or not may_reach(self.peer, path, root, want, target):
            raise Forbidden(_denied(self.peer, what, want), code="caller_not_permitted")

    def _known(self, what: str) -> None:
        if self.peer is None and not self.trusted:
            raise Forbidden(
                f"{what}: the caller cannot be identified (neither a Unix socket nor loopback "
                "TCP) and no bearer token is configured: set FRAMEWIRE_TOKEN",
                code="caller_unknown",
            )


TRUSTED = Access(None, trusted=True)  # the worker's own calls (the CLI's local encode)


def _denied(peer: Peer, what: str, want: int) -> str:
    verb = "write" if want & WRITE else "read"
    return f"{what}: uid {peer.uid} may not {verb} it, so the worker will not for it"
