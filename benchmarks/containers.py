"""The worker and the ranks in containers of their own, as compose runs them (podman here):
benchmarks/ranks.py's ``--placement container``.

The worker's container is compose.yaml's ``worker`` service as shipped (its image, init,
environment and ``cpu_shares``), with the sockets, outputs and inputs bound to
directories of this host (the savers here reach it through the socket, as a rank's
container does through the ``sockets`` volume). The ranks run in a second container of
the same image at the default CPU weight (benchmarks/rank_loop.py). The image is built
once into podman storage kept under the tests' cache (tests/support/podman.py), and
built again when the checkout's source differs from the one it was built from.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.support import CACHE, REPO
from tests.support.http import http_client
from tests.support.podman import IMAGE, Podman, build_base, build_image, install

WORKER_UID = 10001  # the image's user
SOURCES = ("pyproject.toml", "requirements.lock", "docker", "core", "client", "service",
           "integrations")  # fmt: skip


def _source_digest() -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        path = REPO / name
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            if "__pycache__" not in f.parts:
                h.update(str(f.relative_to(REPO)).encode())
                h.update(f.read_bytes())
    return h.hexdigest()


@dataclass
class ContainerWorker:
    """What the savers and the prober need of a worker, as a container serves it."""

    name: str
    root: Path
    podman: Podman = field(repr=False)

    @property
    def uds(self) -> Path:
        return self.root / "sockets" / "api.sock"

    @property
    def uds_url(self) -> str:
        return f"unix://{self.uds}"

    @property
    def fd_socket(self) -> Path:
        return self.root / "sockets" / "fd.sock"

    @property
    def outputs(self) -> Path:
        return self.root / "outputs"

    def stop(self) -> None:
        self.podman("rm", "--force", "--time", "30", self.name, check=False, timeout=120)


class Containers:
    """podman with the worker's image, and the containers of one benchmark run."""

    def __init__(self) -> None:
        install()
        self.podman = Podman(CACHE / "bench-podman")
        self.started: list[str] = []
        self._image()

    def _image(self) -> None:
        digest = _source_digest()
        stamp = self.podman.root / "image.source"
        built = self.podman("image", "exists", IMAGE, check=False).returncode == 0
        if built and stamp.exists() and stamp.read_text() == digest:
            return
        work = self.podman.root / "build"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        if self.podman("image", "exists", "localhost/framewire-test-base:bookworm",
                       check=False).returncode != 0:  # fmt: skip
            build_base(self.podman, work)
        build_image(self.podman, work, REPO)
        stamp.write_text(digest)

    def worker(self, name: str, root: Path, env: dict[str, str]) -> ContainerWorker:
        """compose.yaml's worker, its directories under ``root``, ``env`` added."""
        service = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["worker"]
        compose_env = {k: str(v) for k, v in service["environment"].items() if v is not None}
        for sub in ("sockets", "outputs", "inputs"):
            (root / sub).mkdir(parents=True, exist_ok=True)
            os.chown(root / sub, WORKER_UID, WORKER_UID)
        # The savers here run as root: the fd socket lets them in beside the worker's user.
        environment = compose_env | {"FRAMEWIRE_ALLOWED_UIDS": f"{WORKER_UID},0"} | env
        self.podman("rm", "--force", name, check=False)  # a run that was cut short left it
        argv = ["run", "-d", "--name", name, "--cpu-shares", str(service["cpu_shares"])]
        argv += ["--init"] if service.get("init") else []
        argv += [f"--env={k}={v}" for k, v in environment.items()]
        for here, there in (("sockets", "/run/framewire"), ("outputs", "/data/outputs"),
                            ("inputs", "/data/inputs:ro")):  # fmt: skip
            argv += ["-v", f"{root / here}:{there}"]
        argv.append(IMAGE)
        self.podman(*argv)
        self.started.append(name)
        worker = ContainerWorker(name, root, self.podman)
        deadline = time.monotonic() + 120
        while not _answers(worker.uds):
            if time.monotonic() > deadline:
                logs = self.podman("logs", name, check=False).stderr
                raise RuntimeError(f"the worker's container did not start:\n{logs}")
            time.sleep(0.2)
        return worker

    def ranks(self, n: int, k: int, root: Path) -> Any:
        """``n`` ranks of ``k`` matmuls a step in a container of their own; a function that
        stops them and returns each rank's (ends, seconds)."""
        out = root / "ranks"
        out.mkdir(parents=True, exist_ok=True)
        out.chmod(0o777)
        name = f"framewire-bench-ranks-{os.getpid()}"
        self.podman("run", "-d", "--name", name, "-v", f"{REPO / 'benchmarks'}:/bench:ro",
                    "-v", f"{out}:/out", "--entrypoint", "python", IMAGE, "/bench/rank_loop.py",
                    str(n), str(k), "/out")  # fmt: skip
        self.started.append(name)
        deadline = time.monotonic() + 120
        while not (out / "started").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(self.podman("logs", name, check=False).stderr)
            time.sleep(0.1)

        def stop() -> list[Any]:
            (out / "stop").touch()
            self.podman("wait", name, timeout=120)
            return [tuple(r) for r in json.loads((out / "ranks.json").read_text())]

        return stop

    def close(self) -> None:
        for name in self.started:
            self.podman("rm", "--force", "--time", "10", name, check=False, timeout=120)


def _answers(uds: Path) -> bool:
    if not uds.exists():
        return False
    with contextlib.suppress(Exception), http_client("http://framewire", uds=uds, timeout=2) as c:
        return c.get("/healthz").status_code == 200
    return False


def cpu_weight(podman: Podman, name: str) -> str:
    """The worker container's CPU weight as the kernel applies it (v1 shares, v2 weight)."""
    read = "cat /sys/fs/cgroup/cpu.weight 2>/dev/null || cat /sys/fs/cgroup/cpu/cpu.shares"
    return podman("exec", name, "sh", "-c", read).stdout.strip()
