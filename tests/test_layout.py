"""The shape of the code: a layer order, no import cycles, small modules, a curated
public surface.

Read from the source (ast), so every import counts: those under TYPE_CHECKING
and those inside functions too.
"""

from __future__ import annotations

import ast
import functools
import importlib
import itertools
import re
from pathlib import Path

import pytest

from tests.support import REPO

# The packages, lowest layer first: each imports only those before it (and itself).
PACKAGES = {
    "framewire.core": REPO / "core",
    "framewire.client": REPO / "client",
    "framewire.service": REPO / "service",
    # Beside the service, not under it: stands on the client alone (a test says so).
    "framewire.integrations": REPO / "integrations",
}
LAYERS = list(PACKAGES)
MAX_LINES = 400
PUBLIC_MODULES = {
    "framewire.client",
    "framewire.client.wire",
    "framewire.client.distributed",
    "framewire.service",
    "framewire.service.__main__",
    "framewire.integrations",
    "framewire.integrations.sglang",
    "framewire.integrations.vllm_omni",
    "framewire.integrations.diffusers",
}
CLIENT_API = [
    "AsyncClient", "AsyncVideoWriter", "BadRequest", "Cancelled", "Client", "Conflict",
    "Forbidden", "FramewireError", "InsufficientStorage", "Layout", "MediaError", "MediaInfo",
    "NotFound", "OutputResult", "Overloaded", "ReferenceFrames", "Stalled", "StoreError",
    "Unauthorized", "Unavailable", "VideoWriter", "__version__", "decode_reference",
    "ffmpeg_identity", "pyav_identity", "save_video", "save_videos",
]  # fmt: skip
WIRE_API = [
    "MAX_CHANNELS", "MAX_FPS", "MAX_FRAMES", "MAX_SAMPLE_RATE", "MAX_SIDE", "MIN_FPS",
    "MIN_SAMPLE_RATE", "AudioDType", "AudioInfo", "AudioSource", "CudaIpcSource", "DType",
    "DecodeRequest", "EncodeOptions", "EncodeRequest", "EncodeResponse", "ErrorInfo",
    "FdRegister", "FdReply", "FdUnregister", "Layout", "MediaInfo", "OutputResult", "OutputSpec",
    "Preset",
    "ProbeRequest", "ProbeResponse", "Profile", "RawHandle", "RegionAudio", "RegionSource",
    "RegisterCudaRegion", "RegisterSystemRegion", "ShmAudio", "ShmSource", "Source",
    "StreamChunk", "StreamChunkAck", "StreamOpen", "StreamOpened", "StreamState", "Timings",
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


# A module named in a string: ``importlib.import_module("framewire.service")``, an
# entry point's ``"framewire.service._local:LocalEncoder"``, a lazy name table.
NAMED = re.compile(r"framewire(?:\.\w+)+(?=:\w+$|$)")


def prose_and_loggers(tree: ast.AST) -> set[int]:
    """The ids of the strings of ``tree`` that name no lookup: docstrings, and logger
    names (``getLogger("framewire.client")`` is a logger, not the package)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "getLogger":
            found.update(id(arg) for arg in node.args)
    return found


def children_run(tree: ast.AST) -> set[int]:
    """The ids of the strings of ``tree`` that name the module a child process runs:
    the item after ``"-m"`` in a command's list."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            for flag, name in itertools.pairwise(node.elts):
                if isinstance(flag, ast.Constant) and flag.value == "-m":
                    found.add(id(name))
    return found


def named_modules(text: str, known: set[str]) -> set[str]:
    """The framewire module a string names: the longest known prefix of the dotted name
    (``framewire.service.LocalEncoder`` names framewire.service)."""
    found = NAMED.match(text)
    if found is None:
        return set()
    parts = found.group(0).split(".")
    for end in range(len(parts), 1, -1):
        if ".".join(parts[:end]) in known:
            return {".".join(parts[:end])}
    return set()


def imports_of(module: str, path: Path, known: set[str], *, children: bool = False) -> set[str]:
    """The framewire modules ``module`` imports, anywhere in its source, or looks up by
    name: a string naming one counts as an import of it. ``children``: also the modules
    its child processes run (``-m``): no import in this process, so no cycle, but a
    dependency all the same (the layer rule counts them)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    skipped = prose_and_loggers(tree) | (set() if children else children_run(tree))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in skipped:
                found.update(named_modules(node.value, known))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # submodules
    return {m for m in found if m in known and m != module}


def import_graph(*, children: bool = False) -> dict[str, set[str]]:
    return {m: set(targets) for m, targets in _import_graph(children).items()}


@functools.cache
def _import_graph(children: bool) -> dict[str, frozenset[str]]:
    """Parsed once for the file's tests (each parse of the tree is 0.4 s of CPU)."""
    mods = modules()
    return {m: frozenset(imports_of(m, p, set(mods), children=children)) for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of two or more nodes (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

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
                found.append(sorted(component))

    for m in graph:
        if m not in index:
            visit(m)
    return found


def top(module: str) -> str:
    """The layer a module belongs to: framewire.core, .client or .service."""
    return ".".join(module.split(".")[:2])


def unit(module: str) -> str:
    """The package a module counts in for cycles: its subpackage of the layer
    (framewire.service._encode), else itself (framewire.service._worker)."""
    parts = module.split(".")
    if len(parts) > 3 or (parts[2:] and (PACKAGES[top(module)] / parts[2]).is_dir()):
        return ".".join(parts[:3])
    return module


def is_private(module: str) -> bool:
    return any(part.startswith("_") for part in module.split(".")[2:])


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports upward in the layer order, and imports of another layer's private modules."""
    bad = []
    for m, targets in sorted(graph.items()):
        for n in sorted(targets):
            if top(n) == top(m):
                continue
            if LAYERS.index(top(n)) > LAYERS.index(top(m)):
                bad.append(f"{m} -> {n} (upward)")
            elif is_private(n):
                bad.append(f"{m} -> {n} (private to {top(n)})")
    return bad


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for m, targets in graph.items():
        edges = units.setdefault(unit(m), set())
        edges.update(unit(n) for n in targets if unit(n) != unit(m))
    for targets in list(units.values()):
        for n in targets:
            units.setdefault(n, set())
    return units


def test_the_integrations_stand_on_the_client_alone():
    """Engines import framewire.integrations: it reaches the worker through the client's
    public modules only, never the core or the service."""
    graph = import_graph()
    outside = {
        f"{m} -> {n}"
        for m, targets in graph.items()
        if top(m) == "framewire.integrations"
        for n in targets
        if (top(n) != "framewire.integrations" and n not in PUBLIC_MODULES)
        or top(n) == "framewire.service"
    }
    assert outside == set()
    assert not [m for m, t in graph.items() if top(m) != "framewire.integrations"
                and any(top(n) == "framewire.integrations" for n in t)]  # fmt: skip


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_no_import_cycles_between_packages():
    """A subpackage never imports one that imports it back, even through other modules."""
    assert cycles(package_graph(import_graph())) == []


def test_each_layer_imports_only_those_below_and_only_their_public_modules():
    """core <- client <- service: the client never imports the service, the core neither,
    and no layer reaches into another's _private modules."""
    assert layer_violations(import_graph(children=True)) == []


def documented_order() -> list[set[str]]:
    """The service's layer line in docs/architecture.md, as groups, lowest first."""
    text = (REPO / "docs" / "architecture.md").read_text()
    [line] = [x for x in text.splitlines() if x.startswith("_ops") and " -> " in x]
    return [{f"framewire.service.{n.strip()}" for n in g.split(",")} for g in line.split(" -> ")]


def test_the_documented_service_layers_hold():
    """Every service package and top-level module is in the documented line once, and
    imports only those to its left."""
    groups = documented_order()
    rank = {m: i for i, group in enumerate(groups) for m in group}
    graph = package_graph(import_graph())
    service = {u for u in graph if top(u) == "framewire.service" and u != "framewire.service"}
    assert sum(len(g) for g in groups) == len(rank)
    assert set(rank) == service
    upward = [
        f"{a} -> {b}"
        for a in sorted(service)
        for b in sorted(graph[a] & service)
        if rank[b] >= rank[a]
    ]
    assert upward == []


def test_the_cycle_check_sees_cycles(tmp_path):
    """The check itself: a TYPE_CHECKING import back is a cycle too."""
    (tmp_path / "a.py").write_text("from framewire.client.b import x\n")
    back = "if TYPE_CHECKING:\n    from framewire.client.a import y\n"
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\n" + back)
    known = {"framewire.client.a", "framewire.client.b"}
    graph = {
        "framewire.client.a": imports_of("framewire.client.a", tmp_path / "a.py", known),
        "framewire.client.b": imports_of("framewire.client.b", tmp_path / "b.py", known),
    }
    assert graph == {
        "framewire.client.a": {"framewire.client.b"},
        "framewire.client.b": {"framewire.client.a"},
    }
    assert cycles(graph) == [["framewire.client.a", "framewire.client.b"]]


def test_the_import_checks_see_names_looked_up(tmp_path):
    """A module named in a string is an import of it (a lookup by name hides no arrow);
    a logger's name or a docstring is not; a child's ``-m`` counts for the layers alone."""
    (tmp_path / "a.py").write_text(
        '"""Prose naming framewire.service is no import."""\n'
        "import importlib, logging\n"
        'log = logging.getLogger("framewire.client")\n'
        'encoder = importlib.import_module("framewire.service").LocalEncoder\n'
        'point = "framewire.service._local:LocalEncoder"\n'
        'child = [python, "-m", "framewire.service._cli"]\n'
    )
    known = {"framewire.client", "framewire.service", "framewire.service._local",
             "framewire.service._cli", "framewire.core.a"}  # fmt: skip
    path = tmp_path / "a.py"
    assert imports_of("framewire.core.a", path, known) == {
        "framewire.service", "framewire.service._local"
    }  # fmt: skip
    assert imports_of("framewire.core.a", path, known, children=True) == {
        "framewire.service", "framewire.service._local", "framewire.service._cli"
    }  # fmt: skip


def test_the_local_encoder_seam_is_the_services_to_fill():
    """The client's local fallback finds the service's encoder through the core's seam
    (an entry point), so no module of the client or the core names the service."""
    import tomllib

    from framewire.core.local import GROUP, local_encoder
    from framewire.service import LocalEncoder

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared[GROUP] == {"service": "framewire.service._local:LocalEncoder"}
    assert isinstance(local_encoder(None), LocalEncoder)  # the installed metadata agrees
    graph = import_graph(children=True)
    named = {m: t for m, t in graph.items() if top(m) in ("framewire.core", "framewire.client")}
    assert not {m for m, t in named.items() if any(top(n) == "framewire.service" for n in t)}


def test_the_layer_checks_see_what_they_forbid():
    graph = {
        "framewire.service._encode.jobs": {"framewire.service._sources.frames"},
        "framewire.service._sources.frames": {"framewire.service._encode.convert"},
        "framewire.service._encode.convert": set(),
        "framewire.core.frames": {"framewire.client"},
        "framewire.service._local": {"framewire.client._sharing.fd", "framewire.core.wire"},
        "framewire.client": set(),
        "framewire.client._sharing.fd": set(),
        "framewire.core.wire": set(),
    }
    assert cycles(graph) == []
    assert cycles(package_graph(graph)) == [
        ["framewire.service._encode", "framewire.service._sources"]
    ]
    assert layer_violations(graph) == [
        "framewire.core.frames -> framewire.client (upward)",
        "framewire.service._local -> framewire.client._sharing.fd (private to framewire.client)",
    ]


CANCELLING = {"BaseException", "CancelledError", "KeyboardInterrupt", "GeneratorExit"}


def swallowed(source: str) -> list[int]:
    """Lines where a cancellation (or Ctrl-C) can be caught and not raised again: a bare
    ``except``, or one naming BaseException or CancelledError, with no ``raise`` in it,
    and ``contextlib.suppress`` of one of them."""

    def names(node: ast.expr | None) -> set[str]:
        if node is None:
            return {"BaseException"}
        elts = node.elts if isinstance(node, ast.Tuple) else [node]
        return {e.attr if isinstance(e, ast.Attribute) else getattr(e, "id", "") for e in elts}

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ExceptHandler):
            caught = names(node.type) & CANCELLING
            if caught and not any(isinstance(n, ast.Raise) for n in ast.walk(node)):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "suppress":
            lines.extend(node.lineno for arg in node.args if names(arg) & CANCELLING)
    return sorted(lines)


def test_cancellation_is_never_swallowed():
    """Cleanup that must go on catches Exception; what catches more raises it again."""
    found = {m: n for m, p in modules().items() if (n := swallowed(p.read_text()))}
    assert found == {}


def test_the_cancellation_check_sees_a_swallow():
    source = """
try:
    pass
except BaseException:
    log()
try:
    pass
except (OSError, asyncio.CancelledError):
    raise
with contextlib.suppress(asyncio.CancelledError):
    pass
try:
    pass
except:
    pass
"""
    assert swallowed(source) == [4, 10, 14]


def test_no_module_is_over_400_lines():
    long = {
        m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_every_module_is_public_on_purpose_or_private():
    """framewire.core's modules are the project's own (both sides import them), not the
    user's; elsewhere a module is listed public or named _private."""
    for module in modules():
        if module in PUBLIC_MODULES or (top(module) == "framewire.core" and not is_private(module)):
            continue
        parts = module.split(".")[2:]
        assert any(p.startswith("_") for p in parts), (
            f"{module} is neither listed public nor _private"
        )


@pytest.mark.parametrize(("package", "names"), [
    ("framewire.client", CLIENT_API), ("framewire.client.wire", WIRE_API),
    ("framewire.service", SERVICE_API),
])  # fmt: skip
def test_the_public_names_are_pinned(package, names):
    mod = importlib.import_module(package)
    assert sorted(mod.__all__) == sorted(names)
    for name in names:
        assert getattr(mod, name) is not None


def test_the_wire_helpers_that_left_the_client_are_still_found_with_a_warning():
    import framewire.client.wire as wire
    import framewire.core.wire as core_wire

    with pytest.warns(DeprecationWarning, match="import it from framewire.core.wire"):
        assert wire.normalize_uuid is core_wire.normalize_uuid
    with pytest.raises(AttributeError):
        _ = wire.no_such_name


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
        dirs = "core|client|service|tests|benchmarks|scripts"
        named.update(re.findall(rf"`((?:{dirs})/[\w/.-]+)", doc.read_text()))
    missing = sorted(p for p in named if not (REPO / p.split("::")[0]).exists())
    assert missing == []


FIGURE = re.compile(r"\b\d+(?:\.\d+)?x\b|\b\d+(?:\.\d+)? (?:MiB|GiB|ms)\b")


def test_the_readme_quotes_only_figures_of_the_benchmarks_readme():
    """A figure in README.md (a ratio, a size, milliseconds) is one benchmarks/README.md
    reports, so the two cannot come from different runs."""
    readme = (REPO / "README.md").read_text()
    measured = (REPO / "benchmarks" / "README.md").read_text()
    quoted = set(FIGURE.findall(readme))
    assert len(quoted) > 10
    assert sorted(f for f in quoted if f not in measured) == []


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
