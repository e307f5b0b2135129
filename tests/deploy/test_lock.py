"""requirements.lock against pyproject.toml, the environment the tests run in, and the part
the image installs: one set of versions for all three (docs/deployment.md)."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

from tests.support import REPO
from tests.support.image import LOCK, lockfile

lf = lockfile()
PINS = lf.pins(LOCK.read_text())


def wanted(requirement: str) -> bool:
    marker = Requirement(requirement).marker
    return marker is None or marker.evaluate({"extra": ""})


@pytest.mark.parametrize("source", sorted(lf.INPUTS))
def test_every_requirement_of_pyproject_is_pinned_within_its_range(source):
    for text in lf.inputs()[source]:
        req = Requirement(text)
        if not wanted(text):
            continue
        pin = PINS.get(lf.canonical(req.name))
        assert pin is not None, f"{text} ({source}) is not in requirements.lock: run scripts/lock"
        assert req.specifier.contains(pin.version, prereleases=True), (
            f"requirements.lock pins {pin.name}=={pin.version}, outside {text}: run scripts/lock"
        )


@pytest.mark.parametrize("source", sorted(lf.INPUTS))
def test_the_lock_was_made_from_these_requirements(source):
    """What the lock says each input asked for is what pyproject.toml asks for now: a
    requirement added or dropped there without a new lock fails here."""
    asked = {lf.canonical(Requirement(t).name) for t in lf.inputs()[source] if wanted(t)}
    recorded = {name for name, pin in PINS.items() if f"-r {source}" in pin.via}
    assert recorded == asked, "pyproject.toml and requirements.lock disagree: run scripts/lock"


def test_every_pin_is_asked_for_and_has_its_hashes():
    reached = set(lf.needed_by(PINS, "image.in")) | set(lf.needed_by(PINS, "dev.in"))
    assert set(PINS) == reached, f"pinned, but nothing asks for: {set(PINS) - reached}"
    for pin in PINS.values():
        assert re.search(r"--hash=sha256:[0-9a-f]{64}", pin.text), pin.name
    header = LOCK.read_text().splitlines()[:2]
    assert header[1].strip("# ") == "scripts/lock", header


def test_torch_is_left_to_the_deployment():
    """Its build (CUDA version, CPU) is chosen where it is installed; nothing locked needs it."""
    service = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(
        lf.requirement_name(r) == "torch" for r in service["optional-dependencies"]["service"]
    )
    assert "torch" not in PINS
    for pin in PINS.values():
        assert "torch" not in pin.via, f"{pin.name} is pinned only for torch"


def test_this_environment_runs_the_locked_versions():
    """scripts/bootstrap installed the lock: every pin is here at its version."""
    drifted = {
        name: (pin.version, importlib.metadata.version(name))
        for name, pin in PINS.items()
        if importlib.metadata.version(name) != pin.version
    }
    assert drifted == {}, "run scripts/bootstrap (the lock changed since it ran)"


def test_the_image_part_of_the_lock_holds_all_it_needs():
    """What the image installs (``--require-hashes``: nothing unpinned may come in) brings the
    requirements of each of its pins, as their metadata states them."""
    image = lf.needed_by(PINS, "image.in")
    for name in image:
        for text in importlib.metadata.requires(name) or []:
            if wanted(text):
                dep = lf.canonical(Requirement(text).name)
                assert dep in image or dep in lf.ASIDE, f"{name} needs {dep}: not in the image"
    dev_only = {"pytest", "mypy", "ruff", "moto", "playwright", "uv"}
    assert not dev_only & set(image)


def test_the_image_part_is_printed_as_the_build_reads_it():
    run = subprocess.run(
        [sys.executable, str(REPO / "docker" / "lockfile.py"), "image"],
        input=LOCK.read_text(),
        capture_output=True,
        text=True,
        check=True,
    )
    printed = lf.pins(run.stdout)
    assert set(printed) == set(lf.needed_by(PINS, "image.in"))
    assert all(printed[n].text == PINS[n].text for n in printed)  # hashes and all
