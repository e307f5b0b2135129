"""The order a run on several processes hands out its test files: the longest first.

pytest-xdist's ``loadfile`` hands each process a file at a time in the order collected
(``--no-loadscope-reorder``: otherwise those with the most tests go first, which left
the few-test benchmark files, 10-30 s each, for the end, on one or two processes while
the others had nothing left). ``tests/file_walls.json`` holds each file's wall in
seconds on four processes, as ``tests.support.cpu_accounting`` wrote it last
(``.venv/test-cpu/file_walls.json``); a file not in it goes first (it may be long).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest

WALLS = Path(__file__).resolve().parents[1] / "file_walls.json"


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def longest_first(items: list[pytest.Item], walls: Mapping[str, float] | None = None) -> None:
    """Sorts ``items`` by their file's wall, longest first, keeping each file's order."""
    known = json.loads(WALLS.read_text()) if walls is None else walls
    items.sort(key=lambda item: -known.get(file_of(item.nodeid), float("inf")))


def write(walls: Mapping[str, float], path: Path) -> None:
    """The table ``longest_first`` reads, longest first, a file per line."""
    ordered = sorted(walls.items(), key=lambda kv: -kv[1])
    lines = [f"  {json.dumps(name)}: {round(wall, 1)}" for name, wall in ordered]
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")
