"""The soak, short: one client through idle gaps and every kind of worker restart.

benchmarks/soak.py runs the same cycles (tests/support/soak.py) twenty times and more.
"""

from __future__ import annotations

from framewire.client import Client

from tests.support.processes import child_pids
from tests.support.soak import RESTARTS, Soak, open_fds
from tests.support.worker import Worker

ARGS = ("--idle-timeout-s", "1")


def worker_state(worker: Worker) -> tuple[list[str], int, set[int]]:
    """(open descriptors but sockets, registered regions, children) of a worker. Sockets
    are left out: connections close on their own time (the client's pool expiry)."""
    with worker.http() as h:
        regions = h.get("/v2/systemsharedmemory/status").json()
    fds = sorted(f for f in worker.open_fds() if not f.startswith("socket:"))
    return fds, len(regions), worker.children()


def test_one_client_lives_through_restarts_and_idle_gaps(workers):
    soak = Soak(workers, ARGS, gap_s=1.5)
    before = open_fds()  # the worker (and the zygote it is forked from, with its pipes) up
    with Client(soak.worker.uds_url, output_root=soak.worker.outputs) as fw:
        tally = soak.run(fw, cycles=len(RESTARTS))
        # The last worker, served a cycle more: nothing of the calls stays behind.
        soak.work(fw, 100)
        settled = worker_state(soak.worker)
        soak.work(fw, 101)
        assert worker_state(soak.worker) == settled
    assert tally.failed == [], tally.failed
    assert tally.ok >= 3 * len(RESTARTS) + len(RESTARTS) and len(tally.gaps_s) == len(RESTARTS)
    assert worker_state(soak.worker)[1:] == (0, set())  # no region, no child once closed
    left = open_fds() - before  # counted: a binary held once more is a leak too
    assert not left, f"the client left descriptors open: {left}"
    assert child_pids() - {w.pid for w in workers.started} == set()
