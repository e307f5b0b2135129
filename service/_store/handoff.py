"""Outputs to memory: ``memory://<name>`` outputs whose bytes the caller takes, not a file.

Some engines' save contract is bytes (vLLM-omni hands an MP4's bytes to its
storage manager). Such an output is encoded and validated exactly as a file is,
into the spool; then its bytes are copied into a sealed memfd held under a
ticket (128 random bits, in the result's ``handoff``), and the spool file goes.
The caller takes the memfd with one ``take`` on the fd socket: the descriptor
crosses with ``SCM_RIGHTS`` and the caller maps or reads it. A ticket is taken
once; one not taken within ``TTL_S`` is dropped, and at most ``MAX_HELD``
outputs are held (the oldest goes first).
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
from dataclasses import dataclass

from framewire.core.errors import BadRequest, NotFound
from framewire.core.media.argv import OUTPUT_EXTENSIONS

SCHEME = "memory://"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
TTL_S = 120.0
MAX_HELD = 64
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


@dataclass(frozen=True)
class MemoryTarget:
    """``memory://name.mp4``: the name gives the container (its extension), nothing else."""

    name: str

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


@dataclass
class _Held:
    fd: int
    size: int
    expires: float


class Handoffs:
    """Sealed memfds of finished outputs, by ticket, until taken or expired."""

    def __init__(self, ttl_s: float = TTL_S, max_held: int = MAX_HELD):
        self.ttl_s = ttl_s
        self.max_held = max_held
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._lock = threading.Lock()

    def hold(self, src: int, name: str) -> tuple[str, int]:
        """Copy the finished file open at ``src`` into a sealed memfd; returns (ticket, size)."""
        fd = os.memfd_create(f"framewire-output:{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            size = os.fstat(src).st_size
            copied = 0
            while copied < size:  # in the kernel, no copy through this process
                n = os.sendfile(fd, src, copied, size - copied)
                if n == 0:
                    raise OSError("the spooled output shrank while it was copied")
                copied += n
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        except BaseException:
            os.close(fd)
            raise
        ticket = secrets.token_hex(16)
        with self._lock:
            self._expire(time.monotonic())
            while len(self._held) >= self.max_held:
                os.close(self._held.popitem(last=False)[1].fd)
            self._held[ticket] = _Held(fd, size, time.monotonic() + self.ttl_s)
        return ticket, size

    def take(self, ticket: str) -> tuple[int, int]:
        """The memfd (now the caller's to send and close) and its size; once per ticket."""
        with self._lock:
            self._expire(time.monotonic())
            held = self._held.pop(ticket, None)
        if held is None:
            raise NotFound("no output is held under that ticket (taken, or expired)",
                           code="handoff_not_found")  # fmt: skip
        return held.fd, held.size

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def _expire(self, now: float) -> None:
        for ticket in [t for t, h in self._held.items() if h.expires <= now]:
            os.close(self._held.pop(ticket).fd)

    def close(self) -> None:
        with self._lock:
            for held in self._held.values():
                with contextlib.suppress(OSError):
                    os.close(held.fd)
            self._held.clear()
