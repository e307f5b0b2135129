"""Before a hook goes on: which version of the engine is installed, and whether each
function framewire would wrap or call is there with the signature that was verified.

Read from the engine's source files, never by importing them: a plugin loader runs
framewire early in every engine process, and importing the engine's modules from
there could change what the engine imports, and in what order (SGLang's loader says
as much). A target that is missing or spelled otherwise, or an engine version outside
the range verified, is left to the engine, with one WARNING per target.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import logging
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from framewire.integrations._switch import say_once

# Routes the targets that probe as verified in an engine version outside the range
# (their signatures are one of the verified ones); the bytes are then not verified.
UNVERIFIED_ENV = "FRAMEWIRE_INTEGRATIONS_UNVERIFIED"


@dataclass(frozen=True)
class Engine:
    """An engine and the versions of it that framewire was verified against, in order."""

    label: str  # as the engine names itself
    dist: str  # its distribution's name
    versions: tuple[str, ...]

    @property
    def range(self) -> str:
        return f"{self.versions[0]}-{self.versions[-1]}"


@dataclass(frozen=True)
class Target:
    """A function of the engine's (``name``: ``fn`` or ``Class.method`` in ``module``) and
    its parameter list at each verified version, as the source spells it. A version
    missing from ``shapes`` has no such function by design."""

    module: str
    name: str
    shapes: Mapping[str, str] = field(hash=False)

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.name}"


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def source_file(module: str) -> Path | None:
    """Where ``module``'s source lies, found the way the import system would look for it,
    from the deepest of its packages already imported; None when there is no such file."""
    loaded = sys.modules.get(module)
    if loaded is not None and isinstance(getattr(loaded, "__file__", None), str):
        return Path(loaded.__file__)  # type: ignore[arg-type]
    parts = module.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        package = sys.modules.get(".".join(parts[:depth]))
        if package is not None:
            dirs, rest = list(getattr(package, "__path__", None) or []), parts[depth:]
            break
    else:
        spec = importlib.util.find_spec(parts[0])  # a top-level name: imports nothing
        if spec is None or not spec.submodule_search_locations:
            return None
        dirs, rest = list(spec.submodule_search_locations), parts[1:]
    for step in rest[:-1]:
        dirs = [os.path.join(d, step) for d in dirs if os.path.isdir(os.path.join(d, step))]
    for d in dirs:
        for candidate in (
            os.path.join(d, f"{rest[-1]}.py"),
            os.path.join(d, rest[-1], "__init__.py"),
        ):
            if os.path.isfile(candidate):
                return Path(candidate)
    return None


def _shape(args: ast.arguments) -> str:
    """A parameter list as its source spells it, annotations left out."""

    def one(arg: ast.arg, default: ast.expr | None) -> str:
        return arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}"

    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
    parts = [one(a, d) for a, d in zip(positional, [*defaults, *args.defaults], strict=True)]
    if args.posonlyargs:
        parts.insert(len(args.posonlyargs), "/")
    if args.vararg is not None:
        parts.append(f"*{args.vararg.arg}")
    elif args.kwonlyargs:
        parts.append("*")
    parts += [one(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    if args.kwarg is not None:
        parts.append(f"**{args.kwarg.arg}")
    return f"({', '.join(parts)})"


def _defined(body: Iterable[ast.stmt], name: str) -> ast.stmt | None:
    """The last top-level definition of ``name`` in ``body`` (the one the module keeps)."""
    found = None
    for node in body:
        kinds = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
        if isinstance(node, kinds) and node.name == name:
            found = node
    return found


def signature(path: Path, name: str) -> str | None:
    """The parameter list of function ``name`` (``Class.method`` too) in the file at
    ``path``; None when the file defines no such function."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    node: ast.stmt | None = None
    body: Iterable[ast.stmt] = tree.body
    for part in name.split("."):
        node = _defined(body, part)
        if node is None:
            return None
        body = getattr(node, "body", [])
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    return _shape(node.args)


class Probe:
    """One engine as installed in this process, and the targets it lets framewire hook."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.version = installed_version(engine.dist)
        self.verified = self.version in engine.versions
        self.unverified_ok = os.environ.get(UNVERIFIED_ENV, "") == "1"
        self._found: dict[Target, str | None] = {}

    def _found_shape(self, target: Target) -> str | None:
        if target not in self._found:
            path = source_file(target.module)
            self._found[target] = None if path is None else signature(path, target.name)
        return self._found[target]

    def wanted(self, target: Target) -> bool:
        """Whether ``target`` exists at this version by design (any target may, outside
        the range: the probe says whether it does)."""
        return not self.verified or self.version in target.shapes

    def problem(self, target: Target) -> str | None:
        """Why ``target`` cannot be hooked here; None when it can."""
        found = self._found_shape(target)
        if found is None:
            return "is missing"
        if self.verified and self.version is not None:
            expected = [target.shapes[self.version]]
        else:
            expected = sorted(set(target.shapes.values()))
        if found not in expected:
            return f"has the parameters {found}, not the verified {' or '.join(expected)}"
        return None

    def allows(self, targets: Iterable[Target]) -> bool:
        """Whether every one of ``targets`` may be hooked (or called), each problem said
        once. Outside the verified range, only with FRAMEWIRE_INTEGRATIONS_UNVERIFIED=1."""
        label, version = self.engine.label, self.version or "(no version found)"
        ok = True
        for target in targets:
            why = self.problem(target)
            if why is not None:
                ok = False
                say_once(
                    f"probe:{target.dotted}",
                    "framewire: %s %s: %s %s; its saves run %s's own code",
                    label,
                    version,
                    target.dotted,
                    why,
                    label,
                    level=logging.WARNING,
                )
        if not self.verified and not self.unverified_ok:
            say_once(
                f"probe:{self.engine.dist}",
                "framewire: %s %s is outside the versions "
                "verified (%s): every save runs %s's own code (%s=1 routes the targets "
                "that probe as verified)",
                label,
                version,
                self.engine.range,
                label,
                UNVERIFIED_ENV,
                level=logging.WARNING,
            )
            return False
        return ok
