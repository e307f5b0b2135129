"""How an encoder child yields the CPU to the ranks beside the worker: its threads'
niceness and scheduling policy, and its scheduling group's niceness (DESIGN 7)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

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
    container's CPU weight places) this changes nothing. False where it could not be set."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as group:
            group.write(str(nice))
    except OSError:  # no autogroup in this kernel, gone already, or a sandbox forbids it
        return False
    return True
