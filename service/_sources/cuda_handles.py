"""One producer allocation's IPC handle opened and let go of one step at a time.

torch keeps one mapping per handle in a process (its IPC cache, keyed by the handle)
and closes it when the last storage over it dies. A request opening a handle on a
thread while another request's source over the same allocation dies on another (the
event loop, in the past) can find the cache entry half gone: torch's internal assert,
or a second ``cudaIpcOpenMemHandle`` of a handle still mapped, answered as if the
handle were invalid. SGLang's parallel save does exactly this: several outputs, each a
view of one batch tensor. So every open of a handle, and every drop of a source over
it, holds that handle's lock; the mapping itself is torch's, opened and closed as
torch does, never kept past its last source.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class _Entry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0


class HandleLocks:
    """A lock per IPC handle while a source of it is open or opening."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._entries: dict[bytes, _Entry] = {}

    def _take(self, handle: bytes) -> _Entry:
        with self._guard:
            entry = self._entries.setdefault(handle, _Entry())
            entry.users += 1
            return entry

    def _let_go(self, handle: bytes, entry: _Entry) -> None:
        with self._guard:
            entry.users -= 1
            if entry.users == 0:
                del self._entries[handle]

    def open(self, handle: bytes, fn: Callable[[], T]) -> T:
        """``fn()`` (the open) under ``handle``'s lock; the handle stays counted until
        :meth:`close` unless ``fn`` raises."""
        entry = self._take(handle)
        try:
            with entry.lock:
                return fn()
        except BaseException:
            self._let_go(handle, entry)
            raise

    def close(self, handle: bytes, drop: Callable[[], None]) -> None:
        """``drop()`` (the source's last reference to the mapping) under the lock."""
        with self._guard:
            entry = self._entries.get(handle)
        if entry is None:
            drop()  # not counted: nothing else of this handle is open
            return
        try:
            with entry.lock:
                drop()
        finally:
            self._let_go(handle, entry)

    def __len__(self) -> int:
        with self._guard:
            return len(self._entries)
