"""The order a run on several processes hands out its test files.

pytest-xdist's ``loadfile`` hands each process a file at a time in the order collected
(``--no-loadscope-reorder``: otherwise those with the most tests go first, which left
the few-test benchmark files, 10-30 s each, for the end, on one or two processes while
the others had nothing left). Here the longest go first, except the files that mostly
wait (on timeouts, idle gaps, a player): those are spread among the others, one after
every few, so that no two of them leave the cores idle together.

``tests/file_walls.json`` holds each file's wall and CPU in seconds in a run on four
processes, as ``tests.support.cpu_accounting`` wrote them last
(``.venv/test-cpu/file_walls.json``); a file not in it goes first (it may be long).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest

WALLS = Path(__file__).resolve().parents[1] / "file_walls.json"
# A file that waits: its CPU under a fifth of its wall (a busy one takes about half,
# four processes sharing two cores). The first LEAD files are busy ones, then one
# waiting file after every EVERY busy ones.
WAITS_BELOW, LEAD, EVERY = 0.2, 8, 4

Table = Mapping[str, Mapping[str, float]]  # file -> {"wall": s, "cpu": s}


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def order(files: list[str], table: Table) -> list[str]:
    """``files`` in the order to hand them out."""
    unknown = [f for f in files if f not in table]
    known = sorted((f for f in files if f in table), key=lambda f: -table[f]["wall"])
    waiting = [f for f in known if table[f]["cpu"] < WAITS_BELOW * table[f]["wall"]]
    busy = [f for f in known if f not in waiting]
    spread = busy[:LEAD]
    for i, name in enumerate(waiting):
        spread += [name, *busy[LEAD + i * EVERY : LEAD + (i + 1) * EVERY]]
    return unknown + spread + busy[LEAD + len(waiting) * EVERY :]


def in_order(items: list[pytest.Item], table: Table | None = None) -> None:
    """Sorts ``items`` file by file in ``order``'s, keeping each file's tests in theirs."""
    known = json.loads(WALLS.read_text()) if table is None else table
    files = list(dict.fromkeys(file_of(item.nodeid) for item in items))
    rank = {name: i for i, name in enumerate(order(files, known))}
    items.sort(key=lambda item: rank[file_of(item.nodeid)])


def write(walls: Mapping[str, float], cpus: Mapping[str, float], path: Path) -> None:
    """The table ``in_order`` reads, longest first, a file per line."""
    ordered = sorted(walls, key=lambda name: -walls[name])
    lines = [
        f'  {json.dumps(n)}: {{"wall": {walls[n]:.1f}, "cpu": {cpus[n]:.1f}}}' for n in ordered
    ]
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")
