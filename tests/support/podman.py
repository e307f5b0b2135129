"""Debian's podman, set up to build and run the worker's image on this kind of machine,
with everything it makes kept apart from the machine's own containers.

What this machine needs is in a containers.conf of the tests' own (CONTAINERS_CONF), never
in /etc: it refuses to raise rlimits (so the containers get the limits this process has)
and mixes cgroup v1 and v2, which crun rejects (so runc). Storage, the network
definitions and the runtime state live under one directory of the tests (a
storage.conf, CONTAINERS_STORAGE_CONF): what a run leaves there is seen at once,
and removed with it.
"""

from __future__ import annotations

import configparser
import os
import resource
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlparse

from tests.support.apt import apt_install

# Debian's packages: podman, its runtime and init, the network stack compose's network
# needs (named: with recommends off, apt may pick another), and mmdebstrap for the base.
PACKAGES = ("podman", "runc", "catatonit", "netavark", "aardvark-dns", "iptables",
            "mmdebstrap", "uidmap")  # fmt: skip
NPROC_CAP = 32768  # podman's conmon runs with this nproc here: higher is refused


def install() -> None:
    """Debian's podman and mmdebstrap, when this machine lacks them."""
    missing = apt_install(
        PACKAGES, lambda: all(shutil.which(b) for b in ("podman", "runc", "mmdebstrap"))
    )
    if missing is not None:
        raise RuntimeError(missing)


class Podman:
    """podman with the tests' own configuration, state and storage under ``root``."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], NPROC_CAP)
        (root / "containers.conf").write_text(
            "[containers]\n"
            f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
            "[engine]\n"
            'runtime = "runc"\n'
            f'tmp_dir = "{root}/tmp"\n'
            "[network]\n"
            f'network_config_dir = "{root}/networks"\n'
        )
        (root / "storage.conf").write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{root}/storage"\nrunroot = "{root}/run"\n'
        )
        self.env = os.environ | {
            "CONTAINERS_CONF": str(root / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(root / "storage.conf"),
        }

    def __call__(
        self, *args: str, check: bool = True, timeout: float = 120, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        run = subprocess.run(
            ["podman", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
        )
        if check and run.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)}: {run.returncode}\n{run.stderr}")
        return run

    def command(
        self, argv: Sequence[str], timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """Another program that drives podman (podman-compose), with this configuration."""
        return subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def inspect(self, name: str, field: str) -> str:
        return self("inspect", name, "--format", "{{" + field + "}}").stdout.strip()

    def wait_exit(self, name: str, timeout: float) -> int:
        """The exit status of container ``name``, once it has exited."""
        return int(self("wait", name, timeout=timeout).stdout.strip().splitlines()[-1])

    def wait_until(self, what: str, ready: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout:g} s: {what}")
            time.sleep(0.5)

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, pods, volumes and networks that exist now (none after a test)."""
        listings = {
            "containers": ("ps", "-a", "--format", "{{.Names}}"),
            "pods": ("pod", "ls", "--format", "{{.Name}}"),
            "volumes": ("volume", "ls", "--format", "{{.Name}}"),
        }
        found = {k: self(*argv).stdout.split() for k, argv in listings.items()}
        nets = self("network", "ls", "--format", "{{.Name}}").stdout.split()
        found["networks"] = [n for n in nets if n != "podman"]  # podman's own default
        return found

    def reset(self) -> None:
        """Everything under ``root`` gone: storage (its mounts first), state, configuration."""
        self("system", "reset", "--force", check=False, timeout=300)
        shutil.rmtree(self.root, ignore_errors=True)


def pip_build_mounts(workdir: Path) -> list[str]:
    """``podman build`` arguments giving the build's pip this machine's pip configuration
    (every file and environment variable pip reads, merged into one pip.conf) and the
    local files it names (the CA bundle, find-links directories, file:// indexes)."""
    run = subprocess.run(
        ["python3", "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    )
    merged: dict[str, str] = {}
    for line in run.stdout.splitlines():
        key, _, value = line.partition("=")
        scope, _, name = key.rpartition(".")
        if scope.endswith("global") or scope.startswith(":env:"):
            merged[name] = value.strip("'\"")
    config = configparser.ConfigParser()
    config["global"] = merged
    conf = workdir / "pip.conf"
    with conf.open("w") as f:
        config.write(f)
    mounts = ["-v", f"{conf}:/etc/pip.conf:ro"]
    seen: set[str] = set()
    for value in merged.values():
        for word in value.split():
            path = urlparse(word).path if word.startswith("file://") else word
            if not path.startswith("/") or not os.path.exists(path):
                continue
            # An index's pages link to files beside it (/opt/pypi/simple -> /opt/pypi/files).
            top = str(Path(path).parent) if word.startswith("file://") else path
            if top not in seen:
                seen.add(top)
                mounts += ["-v", f"{top}:{top}:ro"]
    return mounts


BASE = "localhost/framewire-test-base:bookworm"
IMAGE = "localhost/framewire:0.1.0"  # compose.yaml's and the manifests' framewire:0.1.0


def debian_sources() -> list[str]:
    """This machine's apt sources, for mmdebstrap (its mirror is the one this machine uses)."""
    deb822 = Path("/etc/apt/sources.list.d/debian.sources")
    return [str(deb822)] if deb822.exists() else []


def build_base(podman: Podman, work: Path) -> None:
    """The base: Debian's python3 (what python:3.11-slim-bookworm gives, from Debian packages)."""
    subprocess.run(
        ["mmdebstrap", "--variant=minbase", "--quiet",
         "--include=python3,python3-venv,python-is-python3,passwd,ca-certificates",
         "--aptopt=Acquire::Check-Valid-Until false",
         "bookworm", str(work / "base.tar"), *debian_sources()],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    podman("import", "--change", 'CMD ["/bin/bash"]', str(work / "base.tar"), BASE, timeout=300)


def build_image(podman: Podman, work: Path, context: Path, tag: str = IMAGE) -> None:
    """docker/Dockerfile of ``context`` built on the base, with this machine's torch and pip."""
    from importlib.metadata import version

    torch = f"torch=={version('torch').split('+')[0]}"
    podman(
        "build", "--format", "docker", "--network", "host", "--layers",
        "-f", str(context / "docker" / "Dockerfile"), "-t", tag,
        "--build-arg", f"PYTHON_IMAGE={BASE}", "--build-arg", f"TORCH_SPEC={torch}",
        *pip_build_mounts(work), str(context), timeout=1800,
    )  # fmt: skip
