"""The shape of the code: no import cycles, small modules, a curated public surface.

Read from the source (ast), so every import counts: those under TYPE_CHECKING
and those inside functions too.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from tests.support import REPO

PACKAGES = {"framewire.client": REPO / "client", "framewire.service": REPO / "service"}
MAX_LINES = 400
PUBLIC_MODULES = {
    "framewire.client",
    "framewire.client.wire",
    "framewire.client.distributed",
    "framewire.service",
    "framewire.service.__main__",
}
CLIENT_API = [
    "AsyncClient", "AsyncVideoWriter", "BadRequest", "Cancelled", "Client", "Conflict",
    "Forbidden", "FramewireError", "InsufficientStorage", "Layout", "MediaError", "MediaInfo",
    "NotFound", "OutputResult", "Overloaded", "ReferenceFrames", "Stalled", "StoreError",
    "Unauthorized", "Unavailable", "VideoWriter", "__version__", "decode_reference", "save_video",
    "save_videos",
]  # fmt: skip
SERVICE_API = [
    "AlreadyServed", "EncodeParams", "Encoder", "FileSource", "FrameSource", "LocalEncoder",
    "Settings",
    "TensorSource", "Worker", "__version__", "main", "open_npy",
]  # fmt: skip


def modules() -> dict[str, Path]:
    found = {}
    for name, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([name, *parts])] = path
    return found


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The framewire modules ``module`` imports, anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # submodules
    return {m for m in found if m in known and m != module}


def test_no_import_cycles():
    mods = modules()
    graph = {m: imports_of(m, p, set(mods)) for m, p in mods.items()}
    # Tarjan's strongly connected components: a component of two or more is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in graph[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in graph:
        if m not in index:
            visit(m)
    assert cycles == []


def test_the_cycle_check_sees_cycles(tmp_path):
    """The check itself: a TYPE_CHECKING import back is a cycle too."""
    (tmp_path / "a.py").write_text("from framewire.client.b import x\n")
    back = "if TYPE_CHECKING:\n    from framewire.client.a import y\n"
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\n" + back)
    known = {"framewire.client.a", "framewire.client.b"}
    assert imports_of("framewire.client.a", tmp_path / "a.py", known) == {"framewire.client.b"}
    assert imports_of("framewire.client.b", tmp_path / "b.py", known) == {"framewire.client.a"}


def test_no_module_is_over_400_lines():
    long = {
        m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_every_module_is_public_on_purpose_or_private():
    for module in modules():
        if module in PUBLIC_MODULES:
            continue
        parts = module.split(".")[2:]
        assert any(p.startswith("_") for p in parts), (
            f"{module} is neither listed public nor _private"
        )


@pytest.mark.parametrize(("package", "names"), [
    ("framewire.client", CLIENT_API), ("framewire.service", SERVICE_API)
])  # fmt: skip
def test_the_public_names_are_pinned(package, names):
    mod = importlib.import_module(package)
    assert sorted(mod.__all__) == sorted(names)
    for name in names:
        assert getattr(mod, name) is not None


def test_importing_the_service_package_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, framewire.service; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def documented_imports() -> list[str]:
    """Every ``import``/``from framewire...`` line of a Python block in README.md and docs/."""
    lines = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S):
            for line in block.splitlines():
                if re.match(r"\s*(from framewire[\w.]* import|import framewire)", line):
                    lines.append(line.strip())
    return lines


def test_every_documented_import_works():
    lines = documented_imports()
    assert lines, "the docs show no imports?"
    for line in lines:
        exec(compile(line, "<docs>", "exec"), {})  # an ImportError fails the test


def test_every_test_the_docs_name_exists():
    """``tests/...py::test_name`` in README.md, docs/ and benchmarks/README.md."""
    named = set()
    for doc in [
        REPO / "README.md",
        REPO / "benchmarks" / "README.md",
        *(REPO / "docs").glob("*.md"),
    ]:
        named.update(re.findall(r"(tests/[\w/]+\.py)::(\w+)", doc.read_text()))
    assert named
    missing = []
    for path, test in sorted(named):
        source = REPO / path
        if not source.exists() or not re.search(rf"^def {test}\b", source.read_text(), re.M):
            missing.append(f"{path}::{test}")
    assert missing == []


def test_every_module_the_docs_name_exists():
    named = set()
    for doc in [
        REPO / "README.md",
        REPO / "benchmarks" / "README.md",
        *(REPO / "docs").glob("*.md"),
    ]:
        named.update(
            re.findall(r"`((?:client|service|tests|benchmarks|scripts)/[\w/.-]+)", doc.read_text())
        )
    missing = sorted(p for p in named if not (REPO / p.split("::")[0]).exists())
    assert missing == []


def test_every_package_is_installed():
    # The image installs the wheel, not the tree: a package missing from pyproject's
    # list is missing there (and only there).
    import tomllib

    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join([name, *init.parent.relative_to(root).parts])
        for name, root in PACKAGES.items()
        for init in root.rglob("__init__.py")
    }
    assert found == listed
