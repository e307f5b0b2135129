"""Rank-like client processes, each stepped by the test over a pipe.

Each is a fork of the test process (which has imported the client): it says
``started``, waits for ``go``, asks the worker for the decode, reads every byte
(so every page is mapped), sends its answer, waits for ``measure``, sends the
PSS of its mapping, waits for ``exit``. The test holds all of them at each step,
so the measurement is taken while all of them hold the mapping.
"""

from __future__ import annotations

import hashlib
import multiprocessing
from contextlib import AbstractContextManager
from multiprocessing.connection import Connection
from pathlib import Path

from framewire.client import Client

from tests.support.refclips import mapping_pss_kib
from tests.support.stepped import Stepped, stepped

DEADLINE = 60.0  # a hung worker fails the test, never blocks it


def _step(conn: Connection, expected: str) -> None:
    if not conn.poll(DEADLINE) or conn.recv() != expected:
        raise SystemExit(f"expected {expected!r}")


def _rank(sock: str, video: str, fps: float, width: int, height: int, conn: Connection) -> None:
    conn.send("started")
    _step(conn, "go")
    with (
        Client(fd_socket=sock, timeout=DEADLINE) as client,
        client.decode_reference(
            video, fps=fps, width=width, height=height, local_fallback=False
        ) as ref,
    ):
        digest = hashlib.sha256(ref.frames).hexdigest()
        conn.send({"sha256": digest, "nbytes": ref.nbytes, "cached": ref.cached,
                   "source": ref.source})  # fmt: skip
        _step(conn, "measure")
        conn.send({"pss_kib": mapping_pss_kib()})
        _step(conn, "exit")


def decode_ranks(
    n: int, sock: Path, video: Path, fps: float, width: int, height: int
) -> AbstractContextManager[Stepped]:
    """``n`` rank processes started and said ``started``; all exited, or killed, after."""
    args = (str(sock), str(video), fps, width, height)
    return stepped(multiprocessing.get_context("fork"), n, _rank, args, DEADLINE)
