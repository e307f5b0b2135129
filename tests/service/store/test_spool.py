"""The upload spool: what a killed worker left there is removed at the next start, and
nothing of a live worker's."""

from __future__ import annotations

import os
import subprocess
import sys

from framewire.service._store.spool import SPOOL, spool_path, sweep


def test_a_dead_workers_spool_files_are_swept_and_a_live_ones_kept(tmp_path):
    root = tmp_path / "outputs"
    root.mkdir()
    mine = spool_path([str(root)], ".mp4")  # makes the spool, mode 0700
    assert mine.parent == root / SPOOL and (mine.parent.stat().st_mode & 0o777) == 0o700
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    gone = mine.parent / f"{dead.stdout.strip()}-{'0' * 16}.mp4"
    live = mine.parent / f"{os.getppid()}-{'1' * 16}.mp4"
    other = mine.parent / "not-ours.mp4"
    for path in (gone, live, other):
        path.write_bytes(b"x")
    assert sweep([str(root)]) == [gone]
    assert not gone.exists() and live.exists() and other.exists()
    live.unlink()
    other.unlink()
