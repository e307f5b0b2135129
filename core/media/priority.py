"""How an encoder child yields the CPU to the ranks beside the worker: its threads'
niceness and scheduling policy, and its scheduling group's niceness (DESIGN 7)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass

from framewire.core.media.procstat import stat_fields

# The scheduling policies an encoder may yield with: ``batch`` weighs as its niceness says
# but never preempts a thread on waking; ``idle`` weighs least whatever its niceness.
POLICIES = {"normal": os.SCHED_OTHER, "batch": os.SCHED_BATCH, "idle": os.SCHED_IDLE}


@dataclass(frozen=True)
class Priority:
    """How a child yields the CPU: niceness added to this process's, and its threads'
    scheduling policy (a key of POLICIES)."""

    nice: int = 0
    policy: str = "normal"

    @property
    def yields(self) -> bool:
        return self.nice > 0 or self.policy != "normal"


FULL = Priority()


def lower_priority(pid: int, priority: Priority) -> None:
    """Give every thread of ``pid`` ``priority`` (Linux keeps both per thread), and its
    scheduling group the same niceness (:func:`group_nice`)."""
    value = min(19, os.getpriority(os.PRIO_PROCESS, 0) + priority.nice)
    policy = POLICIES[priority.policy]
    if priority.nice > 0:
        group_nice(pid, value)
    for _ in range(2):  # a thread made during the first pass by one not yet lowered
        with contextlib.suppress(OSError):  # gone already: its exit is reported
            for tid in map(int, os.listdir(f"/proc/{pid}/task")):
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, tid, value)
                if policy != os.SCHED_OTHER:
                    with contextlib.suppress(OSError):  # a sandbox that forbids it
                        os.sched_setscheduler(tid, policy, os.sched_param(0))


def group_nice(pid: int, nice: int) -> bool:
    """Niceness for the autogroup of ``pid``, a process started in a session of its own.

    Niceness orders threads within one scheduling group only. With autogroup on
    (``/proc/sys/kernel/sched_autogroup_enabled``), every session of a cgroup's root is a
    group of its own, weighed against the others by the group's niceness alone: a worker
    run as a service (its own session) would otherwise weigh as much as the ranks'
    session, whatever its encoders' niceness. Started in a session of its own, an encoder
    is its own group, and its group's niceness is what the ranks' threads are weighed
    against. Without autogroup (off, or the process in a container's cgroup, which the
    container's CPU weight places) this changes nothing.

    The kernel takes one such write a tenth of a second from a process without
    CAP_SYS_ADMIN, counted across the whole host, and refuses the others (EAGAIN): a
    worker not run as root starting encoders together would leave all but the first at
    the ranks' weight. A refused write is retried in the background (:data:`LATER`) until
    taken. False where it could not be set nor retried."""
    return LATER.set(pid, nice)


def _write_group(pid: int, nice: int) -> None:
    with open(f"/proc/{pid}/autogroup", "w") as group:
        group.write(str(nice))


def _started(pid: int) -> bytes | None:
    """When ``pid`` started (field 22, clock ticks since boot): a pid reused is another
    start."""
    fields = stat_fields(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


# The kernel's spacing of unprivileged autogroup writes, and how long one is retried.
GROUP_RETRY_EVERY_S = 0.1
GROUP_RETRY_FOR_S = 10.0


class GroupWrites:
    """Sets autogroups' niceness; a write the kernel refused for now is retried, oldest
    first, one per GROUP_RETRY_EVERY_S, by one thread that runs while any waits: each
    until taken, its process gone (or its pid another process's), or GROUP_RETRY_FOR_S
    passed. Writes are made under one lock: a retry of an older value never lands after
    a newer one for the same group."""

    def __init__(self) -> None:
        self._waiting: dict[int, tuple[int, bytes, float]] = {}  # pid: nice, start, until
        self._lock = threading.Lock()
        self._running = False

    def set(self, pid: int, nice: int) -> bool:
        with self._lock:
            self._waiting.pop(pid, None)  # this value replaces one still waiting
            try:
                _write_group(pid, nice)
            except BlockingIOError:  # within the kernel's tenth of a second since the last
                return self._retry(pid, nice)
            except OSError:  # no autogroup in this kernel, gone, or a sandbox forbids it
                return False
        return True

    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    def _retry(self, pid: int, nice: int) -> bool:
        started = _started(pid)
        if started is None:
            return False
        self._waiting[pid] = (nice, started, time.monotonic() + GROUP_RETRY_FOR_S)
        if not self._running:
            self._running = True
            threading.Thread(target=self._run, name="framewire-autogroups", daemon=True).start()
        return True

    def _run(self) -> None:
        while True:
            time.sleep(GROUP_RETRY_EVERY_S)
            with self._lock:
                if not self._waiting:
                    self._running = False
                    return
                pid, (nice, started, until) = next(iter(self._waiting.items()))
                entry = self._waiting.pop(pid)
                try:
                    if _started(pid) == started:
                        _write_group(pid, nice)
                except BlockingIOError:  # another write took this tenth of a second
                    if time.monotonic() < until:
                        self._waiting[pid] = entry  # to the back: the others' turn first
                except OSError:
                    pass  # gone, or forbidden now: nothing to retry


LATER = GroupWrites()
