"""Work on a thread of its own beside the caller's: its result, or its error, taken after."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Beside(Generic[T]):
    """``work()`` started now on a thread named ``name``. :meth:`result` waits for it and
    returns what it returned, or raises (on the caller's thread) what it raised."""

    def __init__(self, work: Callable[[], T], name: str):
        self._done: list[T] = []
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name=name)
        self._thread.start()

    def _run(self, work: Callable[[], T]) -> None:
        try:
            self._done.append(work())
        except Exception as exc:  # raised again by result(), on the caller's thread
            self._error = exc

    def join(self) -> None:
        self._thread.join()

    def result(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._done[0]
