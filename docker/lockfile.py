"""requirements.lock: what scripts/lock resolves, and the part of it the image installs.

One lock, made by ``uv pip compile --generate-hashes`` from pyproject.toml's requirements,
split in two inputs so that the lock itself records which pins the image needs:

- ``image.in``: the worker's requirements (the core's, and the service and s3 extras);
- ``dev.in``: the dev extra (tests, linters, benchmarks).

torch is in neither: which build (CUDA version, CPU) is the deployment's choice, installed
before the lock (docker/Dockerfile's TORCH_SPEC, scripts/bootstrap's FRAMEWIRE_TORCH).

Standard library only: the image's build runs it before anything is installed.

    python docker/lockfile.py inputs DIR      write DIR/image.in and DIR/dev.in
    python docker/lockfile.py image < LOCK    print the lock's entries the image installs
"""

from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INPUTS = {"image.in": ("", "service", "s3"), "dev.in": ("dev",)}
ASIDE = {"torch"}  # installed before the lock, by the deployment's choice
SELF = "framewire"

_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = _NAME.match(requirement.strip())
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return canonical(match.group(1))


def inputs(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, list[str]]:
    """Each input file's requirements, as pyproject.toml states them (torch and the
    project's own extras left out)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project["optional-dependencies"]
    out: dict[str, list[str]] = {}
    for name, groups in INPUTS.items():
        reqs = [r for g in groups for r in (extras[g] if g else project["dependencies"])]
        out[name] = [r for r in reqs if requirement_name(r) not in ASIDE | {SELF}]
    return out


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    text: str  # the entry as the lock has it: the pin, its hashes and annotations
    via: frozenset[str]  # what asked for it: canonical names, or "-r image.in" and the like


def pins(lock: str) -> dict[str, Pin]:
    """The lock's entries by canonical name."""
    found: dict[str, Pin] = {}
    blocks: list[list[str]] = []
    for line in lock.splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            blocks.append([line])
        elif blocks:
            blocks[-1].append(line)
    for block in blocks:
        spec = block[0].split(";")[0].split()[0]
        name, _, version = spec.partition("==")
        if not version:
            raise ValueError(f"not pinned in the lock: {block[0]!r}")
        via: set[str] = set()
        for line in block[1:]:
            if not line.strip().startswith("#"):
                continue  # a hash
            note = re.sub(r"^via(\s|$)", "", line.strip().removeprefix("#").strip()).strip()
            if note:
                via.add(note if note.startswith("-r ") else canonical(note))
        name = canonical(name.split("[")[0])
        found[name] = Pin(name, version, "\n".join(block), frozenset(via))
    return found


def needed_by(lock: dict[str, Pin], root: str) -> dict[str, Pin]:
    """The pins that input file ``root`` needs: those it asks for, and theirs in turn."""
    chosen = {n for n, p in lock.items() if f"-r {root}" in p.via}
    while True:
        more = {n for n, p in lock.items() if n not in chosen and p.via & chosen}
        if not more:
            return {n: lock[n] for n in sorted(chosen)}
        chosen |= more


def main(argv: list[str]) -> int:
    if argv[:1] == ["inputs"] and len(argv) == 2:
        for name, reqs in inputs().items():
            (Path(argv[1]) / name).write_text("".join(f"{r}\n" for r in reqs))
        return 0
    if argv == ["image"]:
        for pin in needed_by(pins(sys.stdin.read()), "image.in").values():
            print(pin.text)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
