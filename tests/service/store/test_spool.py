"""The upload spool: what a killed worker left there is removed at the next start, and
nothing of a live worker's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from framewire.service._store.spool import SPOOL, Spool

from tests.support.identity import NOBODY


def test_a_dead_workers_spool_files_are_swept_and_a_live_ones_kept(tmp_path):
    root = tmp_path / "outputs"
    root.mkdir()
    spool = Spool([str(root)])
    mine = spool.file(".mp4")  # makes the spool, mode 0700, under a name of its own
    assert mine.parent.name.startswith(f"{SPOOL}-{os.getpid()}-")
    assert (mine.parent.stat().st_mode & 0o777) == 0o700
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    gone = mine.parent / f"{dead.stdout.strip()}-{'0' * 16}.mp4"
    live = mine.parent / f"{os.getppid()}-{'1' * 16}.mp4"
    other = mine.parent / "not-ours.mp4"
    for path in (gone, live, other):
        path.write_bytes(b"x")
    # Swept as the next worker (of another pid) would sweep it while this one runs.
    assert _sweep_as_another(root) == [str(gone)]
    assert not gone.exists() and live.exists() and other.exists()
    live.unlink()
    other.unlink()
    spool.close()
    # The spool of a worker that is gone goes too, once empty; an older worker's bare one too.
    old = root / SPOOL
    old.mkdir(mode=0o700)
    pid = _dead_pid()
    dead = root / f"{SPOOL}-{pid}-{'2' * 16}"
    dead.mkdir(mode=0o700)
    (dead / f"{pid}-{'3' * 16}.mp4").write_bytes(b"x")
    swept = _sweep_as_another(root)
    assert sorted(swept) == sorted(map(str, [old, dead, dead / f"{pid}-{'3' * 16}.mp4"]))
    assert [p.name for p in root.iterdir()] == [mine.parent.name]  # the live one's stays


def _sweep_as_another(root) -> list[str]:
    code = "import sys; from framewire.service._store.spool import sweep; "
    code += "print('\\n'.join(map(str, sweep([sys.argv[1]]))))"
    done = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True,
                          text=True, check=True)  # fmt: skip
    return done.stdout.split()


def test_a_spool_removed_under_the_worker_is_made_again(tmp_path):
    spool = Spool([str(tmp_path)])
    first = spool.file(".mp4").parent
    first.rmdir()
    again = spool.file(".mp4").parent
    assert again != first and again.is_dir()
    fd = spool.open()
    assert os.fstat(fd).st_ino == again.stat().st_ino
    os.close(fd)
    spool.close()


def _dead_pid() -> str:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return done.stdout.strip()


@pytest.mark.parametrize("kind", ["link", "directory"])
def test_the_start_up_sweep_leaves_a_spool_that_is_not_the_workers_own(workers, tmp_path, kind):
    # Another user made the spool's name first: a link to elsewhere, or a directory of
    # theirs. Files there that look spooled by a dead worker are not the worker's to remove.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    outputs = tmp_path / "w" / "outputs"
    outputs.mkdir(parents=True)
    spool = outputs / SPOOL
    if kind == "link":
        spool.symlink_to(elsewhere)
        victim = elsewhere / f"{_dead_pid()}-{'0' * 16}.mp4"
    else:
        spool.mkdir(mode=0o777)
        os.chown(spool, NOBODY, NOBODY)
        victim = spool / f"{_dead_pid()}-{'0' * 16}.mp4"
    victim.write_bytes(b"not the worker's")
    w = workers.start(root=tmp_path / "w")
    assert victim.read_bytes() == b"not the worker's"
    assert "is not the worker's own" in w.log.read_text()
    victim.unlink()
