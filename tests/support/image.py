"""The worker's image as docker/Dockerfile builds it, and its entrypoint run here.

No container engine runs in these tests: the deployment files (compose.yaml,
deploy/kubernetes/) are checked against the Dockerfile's final stage, and the
command they run is run on this machine, with container paths moved into a
temporary directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from tests.support import REPO

DOCKERFILE = REPO / "docker" / "Dockerfile"
LOCK = REPO / "requirements.lock"


def lockfile() -> ModuleType:
    """docker/lockfile.py, the module the image's build runs (not a package: loaded by path)."""
    spec = importlib.util.spec_from_file_location("lockfile", REPO / "docker" / "lockfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("lockfile", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@dataclass
class Dockerfile:
    """The instructions of the final stage that these tests care about."""

    stages: list[str] = field(default_factory=list)  # each FROM's image
    args: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    healthcheck: list[str] | None = None
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    copies: list[list[str]] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)

    @property
    def argv(self) -> list[str]:
        """What a container of the image runs when nothing overrides it."""
        assert self.entrypoint is not None and self.cmd is not None
        return self.entrypoint + self.cmd


def parse_dockerfile(text: str) -> Dockerfile:
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    df = Dockerfile()
    for line in logical:
        word, _, rest = line.partition(" ")
        word, rest = word.upper(), rest.strip()
        if word == "ARG" and not df.stages:
            name, _, default = rest.partition("=")
            df.args[name] = default
        elif word == "FROM":
            df.stages.append(rest.split()[0])
            df.env, df.user, df.healthcheck, df.entrypoint, df.cmd = {}, None, None, None, None
            df.runs = []
        elif word == "ENV":
            df.env.update(dict(item.split("=", 1) for item in shlex.split(rest)))
        elif word == "USER":
            df.user = rest
        elif word == "HEALTHCHECK":
            df.healthcheck = json.loads(rest[rest.index("CMD ") + 4 :])
        elif word == "ENTRYPOINT":
            df.entrypoint = json.loads(rest)
        elif word == "CMD":
            df.cmd = json.loads(rest)
        elif word == "COPY" and "--from" not in rest:
            df.copies.append(rest.split())
        elif word == "RUN":
            df.runs.append(rest)
    return df


def dockerfile() -> Dockerfile:
    return parse_dockerfile(DOCKERFILE.read_text())


def user_ids(df: Dockerfile) -> tuple[int, int]:
    """(uid, gid) of the final stage's user, as its useradd and groupadd lines fix them."""
    runs = " ".join(df.runs)
    uid, gid = re.search(r"--uid (\d+)", runs), re.search(r"--gid (\d+)", runs)
    assert uid and gid, "the image makes no user with a fixed uid and gid"
    return int(uid.group(1)), int(gid.group(1))


def moved(env: dict[str, str], mounts: dict[str, Path]) -> dict[str, str]:
    """``env`` with the paths under each mount point of ``mounts`` (mount point -> a
    directory here) moved to that directory; values may be comma-separated lists."""
    for here in mounts.values():
        here.mkdir(parents=True, exist_ok=True)

    def move(path: str) -> str:
        for target in sorted(mounts, key=len, reverse=True):  # the innermost mount
            if path == target or path.startswith(target.rstrip("/") + "/"):
                return str(mounts[target]) + path[len(target) :]
        return path

    return {k: ",".join(move(p) for p in v.split(",")) for k, v in env.items()}


@contextlib.contextmanager
def entrypoint(
    argv: list[str], env: dict[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` run here as a container would run it, ``argv[0]`` being the console
    script pip installed into this environment; stopped with SIGTERM, which must end
    it with status 0."""
    exe = Path(sys.executable).parent / argv[0]
    assert exe.exists(), f"{exe}: install framewire into this environment"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(exe), *argv[1:]], env=os.environ | env, stdout=out,
                                stderr=out)  # fmt: skip
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    assert code == 0, log.read_text()
