"""Acting as another local user: what a hostile neighbour on the host can ask of the worker,
or pretend to be while it is down."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.http import http_client
from tests.support.worker import Worker, Workers

NOBODY = 65534


def as_nobody(target, *args) -> object:
    """Run ``target(*args)`` in a forked child as uid/gid 65534; returns what it returned."""
    return as_user(NOBODY, target, *args)


def as_user(uid: int, target, *args) -> object:
    """Run ``target(*args)`` in a forked child as uid/gid ``uid``; returns what it returned."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()

    def run() -> None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        try:
            child.send(target(*args))
        except BaseException as exc:
            child.send(f"raised {exc!r}")

    proc = ctx.Process(target=run)
    proc.start()
    try:
        assert parent.poll(60), "the child did not answer"
        return parent.recv()
    finally:
        proc.join(10)


def post_json(url: str, path: str, body: dict) -> tuple[int, str]:
    if url.startswith("unix://"):
        client = http_client("http://framewire", uds=url.removeprefix("unix://"), timeout=60)
    else:
        client = http_client(url, timeout=60)
    with client:
        r = client.post(path, json=body)
        return r.status_code, r.json().get("code", "")


class Impostor:
    """Another local user (uid/gid ``uid``) listening where a worker should be, while it is
    down: a forked child that binds ``address`` (a Unix socket path, or a TCP (host,
    port)), answers each message with ``answer(data)`` (None: nothing), and records
    everything it is sent, with the first bytes behind each descriptor that came along.
    ``received`` holds the records once the block has ended."""

    def __init__(self, address, answer=lambda data: None, uid: int = NOBODY):
        self.address, self.answer, self.uid = address, answer, uid
        self.received: list[tuple[bytes, list[bytes]]] = []

    def _serve(self, control) -> None:
        import array
        import select
        import socket

        os.setgroups([])
        os.setgid(self.uid)
        os.setuid(self.uid)
        family = socket.AF_UNIX if isinstance(self.address, str) else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        if family == socket.AF_INET:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(self.address)
        listener.listen(16)
        control.send("ready")
        conns: list[socket.socket] = []
        records: list[tuple[bytes, list[bytes]]] = []
        while not control.poll(0):
            readable, _, _ = select.select([listener, *conns], [], [], 0.05)
            for sock in readable:
                if sock is listener:
                    conns.append(listener.accept()[0])
                    continue
                try:
                    data, ancillary, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(16))
                except OSError:
                    data, ancillary = b"", []
                if not data:
                    conns.remove(sock)
                    sock.close()
                    continue
                behind = []
                for _, _, cdata in ancillary:
                    for fd in array.array("i", cdata[: len(cdata) - len(cdata) % 4]):
                        behind.append(os.pread(fd, 64, 0))
                        os.close(fd)
                records.append((data, behind))
                reply = self.answer(data)
                if reply:
                    sock.sendall(reply)
        control.send(records)

    def __enter__(self) -> Impostor:
        ctx = multiprocessing.get_context("fork")
        self._control, child = ctx.Pipe()
        self._proc = ctx.Process(target=self._serve, args=(child,))
        self._proc.start()
        assert self._control.poll(30), "the impostor did not start"
        assert self._control.recv() == "ready"
        return self

    def __exit__(self, *exc: object) -> None:
        self._control.send("stop")
        assert self._control.poll(30), "the impostor did not stop"
        self.received = self._control.recv()
        self._proc.join(10)


def http_answer(body: dict):
    """An Impostor's ``answer``: a 200 with ``body`` as JSON to each request it is sent."""
    import json

    raw = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(raw)}\r\n\r\n"
    )
    return lambda data: head.encode() + raw if b"\r\n\r\n" in data else None


def fd_answer(instance: str):
    """An Impostor's ``answer`` on an fd socket: every request is ``ok``, as ``instance``."""
    import json
    import struct

    raw = json.dumps({"ok": True, "pong": True, "instance": instance, "name": "r"}).encode()
    return lambda data: struct.pack(">I", len(raw)) + raw


@contextmanager
def open_worker(*args: str, env: dict[str, str] | None = None) -> Iterator[Worker]:
    """A worker that serves this uid and :data:`NOBODY` (and ``--allowed-uids`` in
    ``args``), whose sockets and roots any local user can reach."""
    base = Path(tempfile.mkdtemp(prefix="framewire-open-"))
    base.chmod(0o755)
    started = Workers(lambda: base)
    try:
        uids = f"{os.getuid()},{NOBODY}"
        w = started.start("--allowed-uids", uids, *args, env=env)
        for path in (w.uds, w.fd_socket):
            path.chmod(0o666)  # any local user may connect
        for root in (w.outputs, w.inputs):
            root.chmod(0o777)
        yield w
    finally:
        started.stop_all()
        shutil.rmtree(base)
