"""Debian packages that tests install when the machine lacks them (chromium, podman), one
apt-get at a time across the suite's processes and scripts/test-image beside them: apt
refuses a second install while one holds its lock, and a test would skip for that."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

LOCK = Path(tempfile.gettempdir()) / "framewire-tests-apt.lock"
TIMEOUT_S = 900


def apt_install(packages: Sequence[str], present: Callable[[], bool]) -> str | None:
    """Install ``packages`` unless ``present()``; None once they are, else why not."""
    if present():
        return None
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return f"{' '.join(packages)} missing, and no apt-get run as root to install them"
    deadline = time.monotonic() + TIMEOUT_S
    with LOCK.open("a") as lock:
        while True:  # another process's install may be the one that brings them
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return f"another install held {LOCK} for {TIMEOUT_S} s"
                time.sleep(1)
        if present():
            return None
        env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
        wait = ["-o", "DPkg::Lock::Timeout=300"]  # an apt run of someone else's
        for cmd in (
            ["apt-get", *wait, "update", "-q"],
            ["apt-get", *wait, "install", "-y", "-q", *packages],
        ):
            left = max(1.0, deadline - time.monotonic())
            done = subprocess.run(cmd, env=env, capture_output=True, timeout=left)
            if done.returncode != 0:
                return f"{' '.join(cmd)} failed: {done.stderr.decode(errors='replace')[-300:]}"
    return None if present() else f"apt-get installed {' '.join(packages)}, but not what was needed"
