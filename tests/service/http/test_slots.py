"""Connection slots against a real worker: nobody who merely reaches a listener holds one
without bound, the ranks on the Unix socket keep theirs, and a worker out of descriptors
waits instead of spinning.

Every test here would hang, or fill the log, on a worker that bounds only each read.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import time
from collections.abc import Callable, Iterator

from tests.support.http import http_client
from tests.support.refclips import RawConnection
from tests.support.worker import Worker


def sockets_held(worker: Worker) -> int:
    return sum(1 for f in worker.open_fds() if f.startswith("socket:"))


def wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@contextlib.contextmanager
def tcp_connections(worker: Worker, n: int) -> Iterator[list[socket.socket]]:
    socks = [socket.create_connection(("127.0.0.1", worker.port)) for _ in range(n)]
    try:
        yield socks
    finally:
        for s in socks:
            s.close()


def test_a_body_dribbled_inside_the_idle_timeout_is_cut_at_the_bound(workers):
    w = workers.start("--idle-timeout-s", "1")
    with socket.create_connection(("127.0.0.1", w.port)) as sock:
        sock.sendall(
            b"POST /v1/videos:encode HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n"
        )
        started = time.monotonic()
        sock.settimeout(0.4)
        answer = b""
        while not answer and time.monotonic() - started < 8:
            with contextlib.suppress(OSError):
                sock.send(b" ")  # one byte each 0.4 s: never idle for a whole second
            with contextlib.suppress(TimeoutError):
                answer = sock.recv(65536)
        took = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert took < 3, f"the body was read for {took:.1f} s"


def settled_sockets(worker: Worker) -> int:
    """The worker's sockets once the harness's own start-up connections are gone."""
    time.sleep(1)
    return sockets_held(worker)


def test_answers_that_are_never_read_do_not_hold_a_connection(workers):
    """Pipelined requests for large answers, none of which is read: the worker's writes
    stall, and the connection is closed an idle timeout later."""
    w = workers.start("--idle-timeout-s", "1")
    before = settled_sockets(w)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", w.port))
    try:
        sock.sendall(b"GET /openapi.json HTTP/1.1\r\nhost: x\r\n\r\n" * 300)  # 8 MB of answers
        time.sleep(3)
        assert wait_for(lambda: sockets_held(w) <= before, 5), "the connection is still held"
    finally:
        sock.close()
    with w.http() as h:
        assert h.get("/healthz").status_code == 200


def test_tcp_callers_cannot_take_the_ranks_slots(workers):
    """Past three quarters of FRAMEWIRE_MAX_CONNECTIONS, only the Unix socket's allowed
    users get a connection: a rank still reaches the worker."""
    w = workers.start("--max-connections", "8")
    with tcp_connections(w, 8) as socks:
        refused = []
        for s in socks:
            s.settimeout(0.5)
            with contextlib.suppress(TimeoutError):
                refused.append(s.recv(4096))
        assert len(refused) == 2 and all(b" 503 " in r for r in refused), refused
        assert all(b"too_many_connections" in r for r in refused)
        with w.http() as h:  # the Unix socket, as this (allowed) uid
            assert h.get("/healthz").status_code == 200
    with http_client(w.tcp_url) as c:  # freed: TCP is served again
        assert c.get("/healthz").status_code == 200


def test_an_fd_peer_that_reads_no_replies_is_closed(workers):
    w = workers.start("--idle-timeout-s", "1")
    before = settled_sockets(w)
    conn = RawConnection(w.fd_socket)
    try:
        conn.sock.sendall(b'{"op": "ping"}\n' * 6000)  # more replies than the socket holds
        time.sleep(3)
        assert wait_for(lambda: sockets_held(w) <= before, 5), "the connection is still held"
    finally:
        conn.close()
    with RawConnection(w.fd_socket) as fresh:
        assert fresh.call({"op": "ping"})[0]["ok"]


def test_an_fd_peer_not_allowed_is_told_once_and_closed(workers):
    w = workers.start("--allowed-uids", "12345")
    before = settled_sockets(w)
    with RawConnection(w.fd_socket) as conn:
        assert conn.call({"op": "ping"})[0]["code"] == "forbidden"
        conn.sock.settimeout(5)
        assert conn.sock.recv(1) == b""  # closed, not waiting for more
    assert wait_for(lambda: sockets_held(w) <= before, 5)


def test_out_of_descriptors_the_listeners_back_off_quietly(workers):
    """With the worker's descriptors spent, pending connections wait in the backlog: one
    warning, no traceback per try, and service resumes once descriptors are free."""
    w = workers.start("--kernel", "pure")  # no compiler importing meanwhile (files to open)
    held = len(w.open_fds())
    soft, hard = resource.prlimit(w.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(w.pid, resource.RLIMIT_NOFILE, (held + 8, hard))
    logged = w.log.stat().st_size
    with tcp_connections(w, 40):
        time.sleep(2)
        grown = w.log.read_text(errors="replace")[logged:]
    assert "out of system resource" not in grown and grown.count("Traceback") == 0, grown[:2000]
    assert len(grown) < 4000, f"{len(grown)} bytes logged in 2 s"
    assert "backing off" in grown
    resource.prlimit(w.pid, resource.RLIMIT_NOFILE, (soft, hard))
    with http_client(w.tcp_url, timeout=10) as c:
        assert c.get("/healthz").status_code == 200
