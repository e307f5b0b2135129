"""Acting as another local user: what a hostile neighbour on the host can ask of the worker."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

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
        transport = httpx.HTTPTransport(uds=url.removeprefix("unix://"))
        client = httpx.Client(base_url="http://framewire", transport=transport, timeout=60)
    else:
        client = httpx.Client(base_url=url, timeout=60)
    with client:
        r = client.post(path, json=body)
        return r.status_code, r.json().get("code", "")


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
