"""Rank-like processes held at the same step: each says ``started``, then answers what
its parent tells all of them at once (``go``, ``measure``, ...). Used by the decode
tests (tests/support/decode_client.py) and benchmarks/decode.py.

Every wait is bounded: a rank that says nothing within ``deadline`` fails the run, and
one that exits reads as EOF. On the way out every rank is joined, killed if it is still
there, and one that exited with a status other than 0 is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any


class Stepped:
    """The parent's ends of ``n`` ranks' pipes."""

    def __init__(self, conns: list[Connection], deadline: float) -> None:
        self.conns, self.deadline = conns, deadline

    def tell(self, word: str) -> None:
        for conn in self.conns:
            conn.send(word)

    def hear(self) -> list[Any]:
        heard = []
        for conn in self.conns:
            if not conn.poll(self.deadline):
                raise TimeoutError(f"a rank said nothing in {self.deadline:g} s")
            heard.append(conn.recv())  # EOFError: it exited
        return heard


@contextmanager
def stepped(
    ctx: Any, n: int, target: Callable[..., None], args: tuple[Any, ...], deadline: float = 60
) -> Iterator[Stepped]:
    """``n`` processes of ``ctx`` (a multiprocessing context) running ``target(*args,
    conn)``, each of which has said ``started``; all exited with status 0 after."""
    procs, conns = [], []
    try:
        for _ in range(n):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=target, args=(*args, theirs))
            proc.start()
            theirs.close()  # so that a rank's exit reads as EOF here
            procs.append(proc)
            conns.append(mine)
        ranks = Stepped(conns, deadline)
        try:
            if ranks.hear() != ["started"] * n:
                raise RuntimeError("a rank did not start")
        except EOFError:
            raise RuntimeError("a rank exited before it started") from None
        yield ranks
        for proc in procs:
            proc.join(deadline)
        if [proc.exitcode for proc in procs] != [0] * n:
            raise RuntimeError(f"ranks exited {[proc.exitcode for proc in procs]}")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for conn in conns:
            conn.close()
