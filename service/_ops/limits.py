"""What the host lets this process use: memory and CPUs, as its cgroups limit them.

Inside a container sysconf and the affinity set describe the host, not the
container's limits, and budgets drawn from them alone would outgrow it: the
kernel then OOM-kills the worker, or throttles every encode at once.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import os
import resource
from collections.abc import Iterator
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cgroup_files(
    v2_name: str,
    v1_controller: str,
    v1_names: tuple[str, ...],
    proc_cgroup: Path,
    root: Path,
) -> Iterator[list[str]]:
    """The contents of a limit's files in this process's cgroup and each ancestor.

    cgroup v2 (also under ``unified/`` on hybrid hosts) yields ``[v2_name]``'s text,
    v1 the texts of ``v1_names`` in the controller's hierarchy, where all are readable.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        places: list[tuple[Path, tuple[str, ...]]]
        if controllers == "":
            places = [(root, (v2_name,)), (root / "unified", (v2_name,))]
        elif v1_controller in controllers.split(","):
            places = [(root / controllers, v1_names)]
        else:
            continue
        own = Path(path.lstrip("/"))
        for base, names in places:
            for group in (own, *own.parents):
                try:
                    yield [(base / group / name).read_text().strip() for name in names]
                except OSError:
                    continue


def cgroup_memory_limit(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> int | None:
    """The tightest memory limit on this process's cgroups, in bytes; None if none is set."""
    limits = [
        int(text)
        for (text,) in _cgroup_files(
            "memory.max", "memory", ("memory.limit_in_bytes",), proc_cgroup, root
        )
        if text.isdigit()  # v2 writes "max" for none
    ]
    return min(limits, default=None)


def cgroup_cpu_limit(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> float | None:
    """The tightest CPU quota on this process's cgroups, in CPUs; None if none is set."""
    limits = []
    for texts in _cgroup_files(
        "cpu.max", "cpu", ("cpu.cfs_quota_us", "cpu.cfs_period_us"), proc_cgroup, root
    ):
        quota_period = texts[0].split() if len(texts) == 1 else texts  # v2: one file
        if len(quota_period) == 2 and all(t.isdigit() for t in quota_period):  # "max", -1: none
            quota, period = map(int, quota_period)
            if period > 0:
                limits.append(quota / period)
    return min(limits, default=None)


def usable_memory() -> int:
    """RAM, or less where a cgroup allows less."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 << 30
    limit = cgroup_memory_limit()
    return total if limit is None else min(total, limit)


def cpu_quota_note(cpu_slots: int) -> str | None:
    """A warning when the CPU quota is below the scheduler's slots: encodes would be
    admitted side by side and then throttled together."""
    quota = cgroup_cpu_limit()
    if quota is None or cpu_slots <= math.ceil(quota):
        return None
    return (
        f"the cgroup CPU quota is {quota:g} CPUs but the scheduler has {cpu_slots} CPU "
        f"slots (the affinity set): set FRAMEWIRE_CPU_SLOTS={max(1, math.floor(quota))} "
        "so that parallel encodes are not throttled together"
    )


def exposure_note(host: str, port: int, token: str | None) -> str | None:
    """A warning when HTTP listens beyond loopback with no bearer token: callers there
    cannot be identified, so they are refused host memory and files, and anyone who
    can reach the port may still write outputs."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback or token is not None:
        return None
    return (
        f"HTTP listens on {host}:{port} beyond loopback and no FRAMEWIRE_TOKEN is set: "
        "set a token, or bind 127.0.0.1 and use the Unix socket"
    )


def raise_open_files_limit(want: int = 65536) -> tuple[int, int]:
    """Lift this process's soft limit on open files towards its hard limit (at most ``want``).

    Every connection, registered region and running ffmpeg holds descriptors; the
    usual soft limit of 1024 is below what the default caps allow together. Returns
    (soft, hard) as they are now.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(hard, want)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return soft, hard
