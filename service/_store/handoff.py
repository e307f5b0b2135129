"""Outputs to memory: ``memory://<name>`` outputs whose bytes the caller takes, not a file.

Some engines' save contract is bytes (vLLM-omni hands an MP4's bytes to its
storage manager). Such an output is encoded and validated exactly as a file is, but
into a memfd of its own (``MemoryHold``: no file, no copy), which is then sealed and
held under a ticket (128 random bits, in the result's ``handoff``).
The caller takes the memfd with one ``take`` on the fd socket: the descriptor
crosses with ``SCM_RIGHTS`` and the caller maps or reads it.

What is held is bounded for everyone and for each caller: only a caller who may use the
fd socket may ask for one (who else could take it?), and only that uid (or root, or the
worker's) takes it; at most ``max_held`` outputs and ``max_bytes`` bytes are held, and a
limited caller holds its share of each (``FRAMEWIRE_USER_SHARE``): past a bound a hold is
refused (429), never made by dropping another's. A ticket is taken once; one not taken
within ``ttl_s`` is dropped by a timer, whether or not anything else happens.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

from framewire.core.errors import BadRequest, Cancelled, Forbidden, NotFound, Overloaded
from framewire.core.media.argv import OUTPUT_EXTENSIONS
from framewire.service._access.peers import Access
from framewire.service._access.peers import allowed as may_use_fd_socket
from framewire.service._ops.shares import Share
from framewire.service._outputs import TempOutput, sha256_of
from framewire.service._settings import Settings

SCHEME = "memory://"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
TTL_S = 120.0
MAX_HELD = 64
MAX_HELD_BYTES = 1 << 30
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


@dataclass(frozen=True)
class MemoryTarget:
    """``memory://name.mp4``: the name gives the container (its extension), nothing else;
    held for ``uid`` to take, counted in ``share``'s part (None: not limited)."""

    name: str
    uid: int | None = None  # None: an unidentified token holder's (the worker's to take)
    share: int | None = None

    def __str__(self) -> str:
        return SCHEME + self.name

    @property
    def suffix(self) -> str:
        return os.path.splitext(self.name)[1].lower()


def parse_memory(raw: str) -> MemoryTarget:
    name = raw.removeprefix(SCHEME)
    if not _NAME.fullmatch(name) or os.path.splitext(name)[1].lower() not in OUTPUT_EXTENSIONS:
        exts = ", ".join(sorted(OUTPUT_EXTENSIONS))
        raise BadRequest(
            f"{raw!r}: a memory output is memory://<name> with one of {exts}", code="bad_url"
        )
    return MemoryTarget(name)


def judge_memory(raw: str, access: Access, settings: Settings) -> MemoryTarget:
    """``raw`` as ``access``'s caller may ask for it: only a caller who may use the fd
    socket, where it would be taken (403 ``memory_output_refused`` otherwise)."""
    memory = parse_memory(raw)
    peer = access.peer
    if not may_use_fd_socket(peer, settings.allowed_uids, settings.allowed_gids):
        caller = "an unidentified caller" if peer is None else f"uid {peer.uid}"
        raise Forbidden(
            f"{raw}: a memory output is taken on the fd socket, which {caller} may not use "
            "(FRAMEWIRE_ALLOWED_UIDS, FRAMEWIRE_ALLOWED_GIDS): write a file or an object "
            "instead",
            code="memory_output_refused",
        )
    assert peer is not None  # the fd socket admits no unidentified caller
    return replace(memory, uid=peer.uid, share=access.share_key)


@dataclass
class _Held:
    fd: int
    size: int
    expires: float
    uid: int | None
    share: int | None


# The muxer each output extension picks (core.media.argv.OUTPUT_EXTENSIONS): a memfd's
# name has no extension to pick it by.
MUXERS = {".mp4": "mp4", ".m4v": "ipod", ".mov": "mov", ".mkv": "matroska"}


@dataclass(frozen=True)
class MemfdOutput(TempOutput):
    """A memory output's memfd as the place its encode writes: ``fd`` is the memfd, named
    ``/proc/self/fd/<fd>`` (a child inherits it, as it would a private directory), and
    ``name`` the output's own, whose extension gives the muxer."""

    @property
    def path(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    @property
    def muxer(self) -> str | None:
        return MUXERS[os.path.splitext(self.name)[1].lower()]

    def digest(self) -> tuple[int, str]:
        # Opened again: a reader of its own, at its own offset.
        with open(os.open(self.path, os.O_RDONLY | os.O_CLOEXEC), "rb") as f:
            return sha256_of(f)


class MemoryHold:
    """A memory output's memfd, which its encode writes into (a follower of the encode:
    service/_outputs.py), so the hold after the encode seals the very bytes written: no
    spool file, no copy of it (85 MB: 35-53 ms here), nothing to remove. The owner of the
    output closes it when the output ends; a memfd not taken by then goes with it."""

    def __init__(self, target: MemoryTarget):
        self.target = target
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        self._fd: int | None = os.memfd_create(f"framewire-output:{target.name}", flags)
        self._lock = threading.Lock()

    def destination(self) -> TempOutput | None:
        """The memfd, where the encode writes (every route truncates it first)."""
        with self._lock:
            if self._fd is None:
                raise Cancelled("the output ended before its encode")
            return MemfdOutput(self._fd, self.target.name)

    def writing(self, temp: TempOutput) -> None:
        """Nothing to follow while the file is written."""

    def check(self) -> None:
        """Nothing can stop the encode from here."""

    def written(self, temp: TempOutput) -> None:
        """Nothing to do when the file is whole: it is the memfd."""

    def taken(self, size: int) -> int | None:
        """The memfd (the caller's from now on) if it holds ``size`` bytes, the digest's."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None and os.fstat(fd).st_size != size:
            os.close(fd)
            return None
        return fd

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class Handoffs:
    """Sealed memfds of finished outputs, by ticket, until taken or expired."""

    def __init__(
        self,
        ttl_s: float = TTL_S,
        max_held: int = MAX_HELD,
        max_bytes: int = MAX_HELD_BYTES,
        per_user: Callable[[int], int | None] = lambda total: None,
    ):
        """``per_user``: what one limited caller may hold of a total (Settings.per_user)."""
        self.ttl_s = ttl_s
        self.max_held = max_held
        self.max_bytes = max_bytes
        self._count = Share(per_user(max_held), "FRAMEWIRE_MAX_HELD_OUTPUTS", "held outputs")
        self._bytes = Share(per_user(max_bytes), "FRAMEWIRE_HELD_OUTPUT_BYTES", "bytes held")
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._total = 0  # bytes held
        self._lock = threading.Condition()
        self._closed = False
        self._timer: threading.Thread | None = None
        self.on_expired: Callable[[int], None] = lambda n: None  # the worker counts them

    def admit(self, target: MemoryTarget) -> None:
        """Refuse (429) a request whose caller holds its share of outputs already, or when
        every slot is taken: judged before its encode, which would be wasted."""
        with self._lock:
            self._admit(target.share, 0)

    def _admit(self, share: int | None, size: int) -> None:
        if len(self._held) >= self.max_held or self._total + size > self.max_bytes:
            raise Overloaded(
                f"{len(self._held)} outputs ({self._total} bytes) are held for their callers to "
                f"take; at most {self.max_held} ({self.max_bytes} bytes) are "
                "(FRAMEWIRE_MAX_HELD_OUTPUTS, FRAMEWIRE_HELD_OUTPUT_BYTES)",
                code="handoffs_full",
                retry_after=self.ttl_s / 4,
            )
        self._count.check(share, 1, self.ttl_s / 4)
        self._bytes.check(share, size, self.ttl_s / 4)

    def keep(self, fd: int, size: int, target: MemoryTarget) -> tuple[str, int]:
        """Seal the memfd ``fd`` (``size`` bytes: an output's) and hold it; returns
        (ticket, size). ``fd`` is held from here, or closed when refused."""
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            ticket = secrets.token_hex(16)
            with self._lock:
                self._admit(target.share, size)  # others may have been held meanwhile
                held = _Held(fd, size, time.monotonic() + self.ttl_s, target.uid, target.share)
                self._keep(ticket, held)
        except BaseException:
            os.close(fd)
            raise
        return ticket, size

    def _keep(self, ticket: str, held: _Held) -> None:
        self._held[ticket] = held
        self._total += held.size
        self._count.add(held.share, 1)
        self._bytes.add(held.share, held.size)
        if self._timer is None:
            self._timer = threading.Thread(
                target=self._expire_on_time, name="framewire-handoffs", daemon=True
            )
            self._timer.start()
        self._lock.notify_all()

    def _drop(self, ticket: str) -> _Held:
        held = self._held.pop(ticket)
        self._total -= held.size
        self._count.add(held.share, -1)
        self._bytes.add(held.share, -held.size)
        return held

    def take(self, ticket: str, uid: int | None) -> tuple[int, int]:
        """The memfd (now the caller's to send and close) and its size; once per ticket,
        by the uid it was held for (or root, or the worker's own uid: ``uid`` None)."""
        with self._lock:
            held = self._held.get(ticket)
            theirs = held is not None and uid not in (0, os.getuid()) and held.uid != uid
            if held is None or theirs:
                # Another's ticket answers as an unknown one does: it tells nothing.
                raise NotFound(
                    "no output is held under that ticket (taken, or expired)",
                    code="handoff_not_found",
                )
            self._drop(ticket)
        return held.fd, held.size

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def held_bytes(self) -> int:
        with self._lock:
            return self._total

    def _expire_on_time(self) -> None:
        """Drop each output its ``ttl_s`` after it was held: the timer's thread."""
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                late = [t for t, h in self._held.items() if h.expires <= now]
                for ticket in late:
                    os.close(self._drop(ticket).fd)
                if late:
                    self.on_expired(len(late))
                # Held in order, each for ttl_s: the first expires first.
                first = next(iter(self._held.values()), None)
                self._lock.wait(None if first is None else first.expires - now)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for held in self._held.values():
                with contextlib.suppress(OSError):
                    os.close(held.fd)
            self._held.clear()
            self._total = 0
            self._lock.notify_all()
        if self._timer is not None:
            self._timer.join(timeout=5)
