"""Each request to the object store bounded as a whole, and cut when its upload stops.

botocore's read timeout bounds each read from the socket, not the answer: a
store that sends one byte a second keeps a request alive for ever, and a thread
blocked in a read sees neither a caller that left nor a shutdown. So every
attempt (each of botocore's retries is one) gets a deadline when it is sent:
``FRAMEWIRE_STORE_TIMEOUT_S``, plus its body's time at ``MIN_RATE``. A watchdog
thread shuts down the connection of an attempt past its deadline, or whose
upload was cancelled: the blocked read or send returns at once and the attempt
fails. botocore may retry it; a cancelled upload's next attempt is refused
before it is sent (``Cancelled``), one past its deadline is retried with a
deadline of its own, and the last one ends as ``store_timeout``.

The connections are botocore's own, of classes that tell the watchdog which
attempt uses them (installed on the client by :meth:`Deadlines.install`).
"""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from framewire.core.errors import Cancelled

MIN_RATE = 256 << 10  # bytes a second a request's body may take, beyond the timeout
_POLL_S = 0.1  # how soon a cancelled upload's connection is cut

_local = threading.local()  # this thread's attempt, and the event that stops its upload


class _Attempt:
    def __init__(self, owner: Deadlines, deadline: float, cancel: threading.Event | None):
        self.owner = owner
        self.deadline = deadline
        self.cancel = cancel
        self.conns: list[Any] = []
        self.cut = False  # its connections were shut down
        self.late = False  # ... because its deadline passed


def _shut(conn: Any) -> None:
    sock = getattr(conn, "sock", None)
    sock = getattr(sock, "socket", sock)  # TLS through a TLS proxy: the socket beneath
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):
            # The plain socket's shutdown, also under TLS: it wakes the thread that
            # reads, and leaves closing the socket to that thread.
            socket.socket.shutdown(sock, socket.SHUT_RDWR)


class Deadlines:
    """The attempts in flight on one store's client, and the watchdog that cuts them."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._attempts: set[_Attempt] = set()
        self._changed = threading.Condition()
        self._watchdog: threading.Thread | None = None
        self._closed = False

    def install(self, client: Any) -> None:
        """Bound every request ``client`` makes from now on."""
        client.meta.events.register("before-send.s3", self._sent)
        client.meta.events.register("response-received.s3", self._answered)
        # botocore's session keeps its pool classes in one dict, shared with its pool
        # managers: the connections they make from now on are ours.
        pools = client._endpoint.http_session._pool_classes_by_scheme
        pools.update(_pool_classes())

    @contextlib.contextmanager
    def stopped_by(self, cancel: threading.Event) -> Iterator[None]:
        """Requests made by this thread inside are cut when ``cancel`` is set."""
        _local.cancel = cancel
        try:
            yield
        finally:
            _local.cancel = None
            self._answered()

    def timed_out(self) -> bool:
        """Whether this thread's last attempt was cut by its deadline."""
        return bool(getattr(_local, "late", False))

    def _sent(self, request: Any = None, **_: Any) -> None:
        """botocore is about to send an attempt (this thread): its deadline starts."""
        self._answered()
        cancel: threading.Event | None = getattr(_local, "cancel", None)
        if cancel is not None and cancel.is_set():
            raise Cancelled("the upload was stopped")
        body = getattr(request, "body", None)
        size = len(body) if isinstance(body, bytes | bytearray) else 0
        attempt = _Attempt(self, time.monotonic() + self.timeout_s + size / MIN_RATE, cancel)
        _local.attempt, _local.late = attempt, False
        with self._changed:
            self._attempts.add(attempt)
            if self._watchdog is None:
                self._watchdog = threading.Thread(
                    target=self._watch, name="framewire-store-deadline", daemon=True
                )
                self._watchdog.start()
            self._changed.notify()

    def _answered(self, **_: Any) -> None:
        """This thread's attempt is over (answered, failed, or the call left)."""
        attempt: _Attempt | None = getattr(_local, "attempt", None)
        if attempt is None:
            return
        _local.attempt = None
        _local.late = attempt.late
        with self._changed:
            self._attempts.discard(attempt)

    def _watch(self) -> None:
        with self._changed:
            while not self._closed:
                now = time.monotonic()
                for attempt in self._attempts:
                    stopped = attempt.cancel is not None and attempt.cancel.is_set()
                    if not attempt.cut and (stopped or attempt.deadline <= now):
                        attempt.cut, attempt.late = True, not stopped
                        for conn in attempt.conns:
                            _shut(conn)
                live = [a for a in self._attempts if not a.cut]
                wait = min((a.deadline - now for a in live), default=None)
                if any(a.cancel is not None for a in live):
                    wait = _POLL_S if wait is None else min(wait, _POLL_S)
                self._changed.wait(wait)

    def join(self, attempt: _Attempt, conn: Any) -> None:
        """``conn`` carries ``attempt`` now (cut at once if the attempt already was)."""
        with self._changed:
            for other in self._attempts:  # a pooled connection goes from one to the next
                if other is not attempt and conn in other.conns:
                    other.conns.remove(conn)
            if conn not in attempt.conns:
                attempt.conns.append(conn)
            if attempt.cut:
                _shut(conn)

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()


def _join(conn: Any) -> None:
    """``conn`` is about to carry this thread's attempt, if it has one."""
    attempt: _Attempt | None = getattr(_local, "attempt", None)
    if attempt is not None:
        attempt.owner.join(attempt, conn)


@functools.cache
def _pool_classes() -> dict[str, type]:
    """botocore's connection pools, whose connections join the attempt that uses them."""
    from botocore.awsrequest import (
        AWSHTTPConnection,
        AWSHTTPConnectionPool,
        AWSHTTPSConnection,
        AWSHTTPSConnectionPool,
    )

    class Joining:
        def connect(self) -> None:
            super().connect()  # type: ignore[misc]
            _join(self)

        def request(self, *args: Any, **kwargs: Any) -> Any:
            _join(self)
            return super().request(*args, **kwargs)  # type: ignore[misc]

    class HTTPConnection(Joining, AWSHTTPConnection):
        pass

    class HTTPSConnection(Joining, AWSHTTPSConnection):
        pass

    class HTTPPool(AWSHTTPConnectionPool):
        ConnectionCls = HTTPConnection

    class HTTPSPool(AWSHTTPSConnectionPool):
        ConnectionCls = HTTPSConnection

    return {"http": HTTPPool, "https": HTTPSPool}
