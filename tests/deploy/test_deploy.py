"""The deployment files: compose.yaml against the Compose Specification, the Dockerfile's
essentials, and the image's entrypoint run here, outside a container, as the compose file
configures it."""

from __future__ import annotations

import importlib.resources
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from framewire.client import Client
from framewire.core.fdsocket import ping

from tests.support import REPO
from tests.support.image import DOCKERFILE, dockerfile, entrypoint, moved
from tests.support.media import make_clip
from tests.support.worker import free_port

COMPOSE = REPO / "compose.yaml"


def compose_schema() -> dict[str, Any]:
    """The Compose Specification's JSON schema, as check-jsonschema ships it (offline)."""
    vendored = importlib.resources.files("check_jsonschema") / "builtin_schemas" / "vendor"
    return json.loads((vendored / "compose-spec.json").read_text())


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_file_is_valid_against_the_compose_specification():
    schema = compose_schema()
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator = validator_class(schema, format_checker=validator_class.FORMAT_CHECKER)
    errors = [
        f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(compose())
    ]
    assert errors == []
    # The schema is strict: a misspelled key is an error, so the check above means something.
    broken = compose()
    broken["services"]["worker"]["shm_sise"] = "1g"
    assert not validator.is_valid(broken)


def _mounts(service: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """target -> (volume name, mode) for short-syntax volume entries."""
    mounts = {}
    for entry in service.get("volumes", []):
        name, target, *mode = entry.split(":")
        mounts[target] = (name, mode[0] if mode else "rw")
    return mounts


def test_compose_worker_has_a_gpu_its_sockets_on_a_volume_and_read_only_inputs():
    doc = compose()
    worker = doc["services"]["worker"]
    assert (REPO / worker["build"]["context"] / worker["build"]["dockerfile"]) == DOCKERFILE
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    # All of the host's GPUs: the ranks' tensors may lie on any of them.
    assert any(
        d["driver"] == "nvidia" and "gpu" in d["capabilities"] and d["count"] == "all"
        for d in devices
    )
    # Frames come as descriptors over the fd socket: no IPC namespace is shared.
    assert "ipc" not in worker and "shm_size" not in worker
    assert "ports" not in worker  # HTTP stays on the container's loopback
    env, mounts = worker["environment"], _mounts(worker)
    named = set(doc["volumes"])
    for var in ("FRAMEWIRE_UDS", "FRAMEWIRE_FD_SOCKET"):
        parent = str(Path(env[var]).parent)
        assert mounts[parent][0] in named, f"{var} is not on a named volume"
    assert mounts[env["FRAMEWIRE_OUTPUT_ROOTS"]] == ("outputs", "rw")
    assert mounts[env["FRAMEWIRE_INPUT_ROOTS"]] == ("inputs", "ro")
    grace = float(env["FRAMEWIRE_SHUTDOWN_GRACE"])
    assert float(worker["stop_grace_period"].removesuffix("s")) > grace


def test_compose_demo_shares_only_the_socket_volume_and_waits_for_it():
    doc = compose()
    worker, demo = doc["services"]["worker"], doc["services"]["demo"]
    assert "ipc" not in demo and "pid" not in demo  # the fd handover needs neither
    assert demo["depends_on"]["worker"]["condition"] == "service_healthy"
    sockets = str(Path(worker["environment"]["FRAMEWIRE_UDS"]).parent)
    assert _mounts(demo)[sockets] == _mounts(worker)[sockets]
    argv = demo["entrypoint"] + demo["command"]
    assert argv[:2] == ["framewire", "demo"]
    assert argv[argv.index("--url") + 1] == f"unix://{worker['environment']['FRAMEWIRE_UDS']}"
    # It waits for that worker itself, bounded (podman-compose ignores the condition above),
    # and never starts one of its own beside it.
    assert float(argv[argv.index("--wait") + 1]) > 0
    # The demo writes the reference where the worker reads it: the same volume, writable.
    inputs = worker["environment"]["FRAMEWIRE_INPUT_ROOTS"]
    assert _mounts(demo)[inputs] == ("inputs", "rw")


def test_dockerfile_essentials():
    df = dockerfile()
    assert df.stages, "no FROM"
    for image in df.stages:
        image = df.args.get(image.strip("${}"), image)
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest", f"{image}: pin a tag"
    assert df.user not in (None, "root", "0"), "the worker must not run as root"
    assert df.entrypoint == ["framewire", "serve"]
    assert df.cmd == []
    assert df.healthcheck is not None and df.healthcheck[0] == "python"
    assert "/healthz" in df.healthcheck[-1]
    assert "FRAMEWIRE_HOST" not in df.env  # loopback, the default
    assert {"FRAMEWIRE_UDS", "FRAMEWIRE_FD_SOCKET"} <= set(df.env)
    text = DOCKERFILE.read_text()
    # The dependency layer, from the lock with hashes, comes before any source is copied in.
    assert text.index("pip install --require-hashes -r") < text.index("COPY client")
    # Every package directory of the wheel is copied into the wheel stage.
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    copied = {source.rstrip("/") for copy in df.copies for source in copy[:-1]}
    assert set(setuptools["package-dir"].values()) <= copied
    # What the image copies is what .dockerignore lets into the build context.
    ignore = (REPO / ".dockerignore").read_text().split()
    assert "*" in ignore
    for copy in df.copies:
        for source in copy[:-1]:
            assert f"!{source.rstrip('/')}" in ignore or f"!{source.rstrip('/')}/" in ignore


def _container_env(tmp_path: Path) -> dict[str, str]:
    """FRAMEWIRE_* as the image and the compose file set them, container paths moved
    under ``tmp_path`` (one directory per volume)."""
    df, worker = dockerfile(), compose()["services"]["worker"]
    env = {k: v for k, v in df.env.items() if k.startswith("FRAMEWIRE_")}
    # The engines' ffmpeg binaries are the image's own files: not on this host.
    env.pop("FRAMEWIRE_ENCODERS")
    # A variable without a value comes from the shell when set there: unset here.
    env |= {k: str(v) for k, v in worker["environment"].items() if v is not None}
    env = moved(env, {target: tmp_path / volume for target, (volume, _) in _mounts(worker).items()})
    # The container has its loopback to itself; here 7700 may be taken.
    env["FRAMEWIRE_PORT"] = str(free_port())
    return env


def test_image_entrypoint_serves_and_stops_cleanly(tmp_path):
    df = dockerfile()
    env = _container_env(tmp_path)
    log = tmp_path / "worker.log"
    with entrypoint(df.argv, env, log) as proc:
        assert df.healthcheck is not None
        check = [sys.executable, *df.healthcheck[1:]]
        deadline = time.monotonic() + 60
        while subprocess.run(check, env=os.environ | env, capture_output=True).returncode != 0:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the image's health check never passed"
            time.sleep(0.2)
        uds = Path(env["FRAMEWIRE_UDS"])
        with Client(f"unix://{uds}") as client:
            result = client.save_video(make_clip(frames=2), "entry/a.mp4", fps=24)
        assert Path(result.path) == tmp_path / "outputs" / "entry" / "a.mp4"
        assert ping(env["FRAMEWIRE_FD_SOCKET"]).ok
    assert not Path(env["FRAMEWIRE_UDS"]).exists()
    assert not Path(env["FRAMEWIRE_FD_SOCKET"]).exists()


@pytest.mark.parametrize("field_name", ["FRAMEWIRE_UDS", "FRAMEWIRE_FD_SOCKET"])
def test_image_and_compose_agree_on_socket_paths(field_name):
    assert (
        dockerfile().env[field_name] == compose()["services"]["worker"]["environment"][field_name]
    )
