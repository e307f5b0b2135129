"""The ``framewire`` command as its tests run it, ``python -m framewire.service ARGS``,
and the benchmark scripts, ``python SCRIPT ARGS``.

Where the zygote can start one (tests/support/zygote.py: the same interpreter, the
same variables read at start), the command is a fork of the zygote, which has
imported it already: its argv parsing, settings, output and exit status are those
of a fresh interpreter, without its second of imports (and torch's two more, for
an encode). Otherwise, or with FRAMEWIRE_TEST_FORK=0, it is a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from tests.support.worker import FORK
from tests.support.zygote import Forked, Zygote, zygote

CLI = [sys.executable, "-m", "framewire.service"]


def start_cli(
    *args: str,
    stdio: tuple[str, str, str],
    env: dict[str, str] | None = None,
    script: Path | None = None,
    cwd: Path | None = None,
) -> Forked | subprocess.Popen[bytes]:
    """The command (or ``script``) running, its descriptors 0, 1 and 2 opened from the
    paths ``stdio`` names (a terminal's, a file's)."""
    forks = zygote() if FORK else None
    return start_process(_argv(args, script), forks, list(args), stdio=stdio, env=env, cwd=cwd,
                         script=script)  # fmt: skip


def _argv(args: tuple[str, ...], script: Path | None) -> list[str]:
    """The fresh interpreter's command line for the command's ``args`` (or ``script``'s)."""
    return [*CLI, *args] if script is None else [sys.executable, str(script), *args]


def start_process(
    argv: list[str],
    forks: Zygote | None,
    forked_args: list[str],
    *,
    stdio: tuple[str, str, str],
    env: dict[str, str] | None,
    cwd: Path | None,
    script: Path | None = None,
    module: str | None = None,
) -> Forked | subprocess.Popen[bytes]:
    """``argv`` running, or where ``forks`` can start it, its fork (``forked_args`` for
    the command, ``script`` or ``module``): descriptors 0, 1 and 2 opened from ``stdio``."""
    if forks is not None and forks.can_start(env):
        return forks.start(forked_args, Path(os.devnull), env, cwd, stdio=stdio, script=script,
                           module=module)  # fmt: skip
    fds = [os.open(stdio[0], os.O_RDWR if stdio[0] in stdio[1:] else os.O_RDONLY)]
    fds += [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for p in stdio[1:]]
    try:
        return subprocess.Popen(argv, stdin=fds[0], stdout=fds[1], stderr=fds[2], env=env, cwd=cwd)
    finally:
        for fd in fds:
            os.close(fd)


def run_cli(
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    script: Path | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """The command (or ``script``) run to its end, as ``subprocess.run(...,
    capture_output=True, text=True)`` would: its exit status and what it wrote."""
    return run_to_end(_argv(args, script), lambda stdio: start_cli(
        *args, stdio=stdio, env=env, script=script, cwd=cwd
    ), timeout)  # fmt: skip


def run_to_end(
    argv: list[str],
    start: Callable[[tuple[str, str, str]], Forked | subprocess.Popen[bytes]],
    timeout: float,
) -> subprocess.CompletedProcess[str]:
    """What ``start(stdio)`` started, run to its end with stdout and stderr captured, as
    ``subprocess.run(argv, capture_output=True, text=True, timeout=...)`` answers."""
    with tempfile.TemporaryDirectory(prefix="framewire-cli-") as scratch:
        out, err = Path(scratch) / "stdout", Path(scratch) / "stderr"
        proc = start((os.devnull, str(out), str(err)))
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())
