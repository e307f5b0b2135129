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
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from framewire.client import Client

from tests.support.refclips import mapping_pss_kib

DEADLINE = 60.0  # a hung worker fails the test, never blocks it


def _step(conn: Connection, expected: str) -> None:
    if not conn.poll(DEADLINE) or conn.recv() != expected:
        raise SystemExit(f"expected {expected!r}")


def _rank(conn: Connection, sock: str, video: str, fps: float, width: int, height: int) -> None:
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


class Ranks:
    """``n`` rank processes, all at the same step."""

    def __init__(self, conns: list[Connection]) -> None:
        self.conns = conns

    def tell(self, word: str) -> None:
        for conn in self.conns:
            conn.send(word)

    def hear(self) -> list[Any]:
        heard = []
        for conn in self.conns:
            if not conn.poll(DEADLINE):
                raise TimeoutError(f"a rank said nothing in {DEADLINE:g} s")
            heard.append(conn.recv())  # EOFError: it exited
        return heard


@contextmanager
def decode_ranks(
    n: int, sock: Path, video: Path, fps: float, width: int, height: int
) -> Iterator[Ranks]:
    """``n`` rank processes started and said ``started``; all exited, or killed, after."""
    ctx = multiprocessing.get_context("fork")
    procs, conns = [], []
    try:
        for _ in range(n):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_rank, args=(theirs, str(sock), str(video), fps, width,
                                                   height))  # fmt: skip
            proc.start()
            theirs.close()  # so that a rank's exit reads as EOF here
            procs.append(proc)
            conns.append(mine)
        ranks = Ranks(conns)
        assert ranks.hear() == ["started"] * n
        yield ranks
        for proc in procs:
            proc.join(30)
        assert [proc.exitcode for proc in procs] == [0] * n
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for conn in conns:
            conn.close()
