"""Outputs to memory: ``memory://<name>`` outputs whose bytes the caller takes, not a file.

Some engines' save contract is bytes (vLLM-omni hands an MP4's bytes to its
storage manager). Such an output is encoded and validated exactly as a file is, but
into a memfd of its own (service/_store/memfile.py: no file, no copy), which is then
sealed and held under a ticket (128 random bits, in the result's ``handoff``). A stream
session's ticket is reserved when it opens (its answer names it), and its output held
as soon as its file is whole: a ``take`` waiting on it answers while the worker still
hashes and checks the file.
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

import asyncio
import contextlib
import fcntl
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from framewire.core.errors import BadRequest, Cancelled, Forbidden, NotFound, Overloaded
from framewire.core.media.argv import OUTPUT_EXTENSIONS
from framewire.service._access.peers import Access
from framewire.service._access.peers import allowed as may_use_fd_socket
from framewire.service._ops.shares import Share
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
    ticket: str | None = None  # reserved when a stream session opened (Handoffs.reserve)

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


@dataclass
class _Reserved:
    """A ticket named before its output exists (a stream session's), and the takes waiting
    for it to be held."""

    uid: int | None
    share: int | None
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = field(
        default_factory=list
    )

    def wake(self) -> None:
        for loop, waiter in self.waiters:
            with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits
                loop.call_soon_threadsafe(_settle, waiter)
        self.waiters.clear()


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _may_take(owner: int | None, uid: int | None) -> bool:
    """Whether ``uid`` takes what is held for ``owner``: the same uid, root, the worker's."""
    return uid in (0, os.getuid()) or owner == uid


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
        self._reserved: dict[str, _Reserved] = {}  # counted with the held
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

    def reserve(self, target: MemoryTarget) -> str:
        """A ticket for an output not encoded yet (a stream session's, named when it opens),
        counted as held until the output is held under it or :meth:`cancel` lets it go."""
        with self._lock:
            self._admit(target.share, 0)
            ticket = secrets.token_hex(16)
            self._reserved[ticket] = _Reserved(target.uid, target.share)
            self._count.add(target.share, 1)
        return ticket

    def cancel(self, ticket: str) -> None:
        """Let go of a reserved ticket whose output was not held (its session ended): the
        takes waiting on it answer that nothing is held. Nothing, once it was held."""
        with self._lock:
            reserved = self._reserved.pop(ticket, None)
            if reserved is not None:
                self._count.add(reserved.share, -1)
                reserved.wake()

    def drop(self, ticket: str) -> None:
        """Let go of what is held under ``ticket``, if it is still held."""
        with self._lock:
            held = self._drop(ticket) if ticket in self._held else None
        if held is not None:
            os.close(held.fd)

    def _admit(self, share: int | None, size: int) -> None:
        outputs = len(self._held) + len(self._reserved)
        if outputs >= self.max_held or self._total + size > self.max_bytes:
            raise Overloaded(
                f"{outputs} outputs ({self._total} bytes) are held for their callers to "
                f"take; at most {self.max_held} ({self.max_bytes} bytes) are "
                "(FRAMEWIRE_MAX_HELD_OUTPUTS, FRAMEWIRE_HELD_OUTPUT_BYTES)",
                code="handoffs_full",
                retry_after=self.ttl_s / 4,
            )
        self._count.check(share, 1, self.ttl_s / 4)
        self._bytes.check(share, size, self.ttl_s / 4)

    def keep(self, fd: int, size: int, target: MemoryTarget) -> tuple[str, int]:
        """Seal the memfd ``fd`` (``size`` bytes: an output's) and hold it, under the
        target's reserved ticket if it has one; returns (ticket, size). ``fd`` is held from
        here, or closed when refused."""
        reserved = None
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            with self._lock:
                ticket = target.ticket or secrets.token_hex(16)
                if target.ticket is not None:
                    reserved = self._reserved.pop(target.ticket, None)
                    if reserved is None:
                        raise Cancelled("the output's session ended before it was held")
                    self._count.add(reserved.share, -1)
                self._admit(target.share, size)  # others may have been held meanwhile
                held = _Held(fd, size, time.monotonic() + self.ttl_s, target.uid, target.share)
                self._keep(ticket, held)
        except BaseException:
            os.close(fd)
            raise
        finally:
            if reserved is not None:
                reserved.wake()  # held, or refused: either way their answer is ready
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
            theirs = held is not None and not _may_take(held.uid, uid)
            if held is None or theirs:
                # Another's ticket answers as an unknown one does: it tells nothing.
                raise NotFound(
                    "no output is held under that ticket (taken, or expired)",
                    code="handoff_not_found",
                )
            self._drop(ticket)
        return held.fd, held.size

    async def take_when_held(self, ticket: str, uid: int | None, wait_s: float) -> tuple[int, int]:
        """:meth:`take`, once the output reserved under ``ticket`` is held: waiting at most
        ``wait_s`` for it (another's reserved ticket is not waited for: it answers as an
        unknown one does)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            with self._lock:
                reserved = self._reserved.get(ticket)
                left = deadline - loop.time()
                if reserved is None or not _may_take(reserved.uid, uid) or left <= 0:
                    return self.take(ticket, uid)
                waiter: asyncio.Future[None] = loop.create_future()
                reserved.waiters.append((loop, waiter))
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter, left)
            finally:
                # A wait that ended first (timed out, cancelled) leaves nothing behind: a
                # client asking again every second would otherwise add one each time.
                with self._lock, contextlib.suppress(ValueError):
                    reserved.waiters.remove((loop, waiter))

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
            for reserved in self._reserved.values():
                reserved.wake()
            self._reserved.clear()
            self._lock.notify_all()
        if self._timer is not None:
            self._timer.join(timeout=5)
