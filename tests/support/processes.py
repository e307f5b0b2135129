"""Child processes and what they leave: who is running, who is gone, temp outputs."""

from __future__ import annotations

import os
import time
from pathlib import Path


def child_pids(pid: int | str = "self") -> set[int]:
    """Children of ``pid``, less the daemons that live as long as their interpreter:
    torch's shm manager, Python's multiprocessing resource tracker (which
    multiprocessing.shared_memory, so tritonclient's regions, starts), and the zygote
    workers are forked from (tests/support/zygote.py)."""
    pids: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            pass
    return {p for p in pids if not _daemon(p)}


def open_memfds(prefix: str = "framewire") -> int:
    """This process's descriptors of memfds named ``prefix...``."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:" + prefix)
        except OSError:
            pass  # the listing's own descriptor, gone already
    return n


def _daemon(pid: int) -> bool:
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    daemons = (b"multiprocessing.resource_tracker", b"tests/support/zygote.py")
    return comm.startswith("torch_shm_manag") or any(d in cmdline for d in daemons)


SPOOL = ".framewire-tmp-spool"  # a worker's upload spool is this and "-<pid>-<hex>"


def is_spool(path: Path) -> bool:
    return path.name == SPOOL or path.name.startswith(SPOOL + "-")


def spools(root: Path) -> list[Path]:
    """The upload spools in ``root``: a worker's stays while it runs, its contents may not."""
    return sorted(p for p in root.iterdir() if is_spool(p))


def framewire_temps(root: Path) -> list[Path]:
    return [
        p
        for p in root.rglob("*")
        if (p.name.startswith(".framewire-tmp-") and not is_spool(p)) or is_spool(p.parent)
    ]


def gone(pid: int) -> bool:
    """Whether ``pid`` has stopped running, every thread of it: a killed process's main
    thread is a zombie while its other threads (x264's) may still be exiting, holding its
    descriptors (the read end of its stdin among them) a little longer."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return True
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # that thread is gone
        if stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
            return False
    return True


def wait_gone(pids: set[int], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not all(gone(p) for p in pids):
        assert time.monotonic() < deadline, f"processes {pids} still running"
        time.sleep(0.05)


def wait_until_writes_stop(pid: int, quiet_s: float = 0.3, timeout: float = 10) -> None:
    """Until ``pid`` has written no byte (``wchar``) for ``quiet_s``."""

    def written() -> int:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
        raise AssertionError("no wchar")

    deadline = time.monotonic() + timeout
    last, since = written(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, "the worker kept writing"
        time.sleep(0.02)
        if (now := written()) != last:
            last, since = now, time.monotonic()
