"""The probe that runs before any hook: the engine's version from its metadata, each
target's parameters read from its source file without importing it, and what it lets
framewire hook (tests/integrations/test_sglang.py and the others run it against the
engines' own files)."""

from __future__ import annotations

import logging
import sys
import textwrap
from pathlib import Path

import pytest
from framewire.integrations import _probe
from framewire.integrations._probe import Engine, Probe, Target, signature, source_file

SOURCE = """
import does_not_exist  # never imported: the probe reads, it does not run

def plain(a, b=1, *args, c, d="x", **kw) -> int: ...

def only(a, /, b, *, c=None): ...

async def waits(x: int = 2 + 3): ...

class Encoder:
    @classmethod
    def open(cls, path, *, fps, quality=None): ...

    def __init__(self, *, width, height): ...

def plain(a, b=2): ...  # the last definition is the module's

value = 3
"""


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``engine_pkg.sub.mod`` with SOURCE, and a distribution ``engine-pkg`` 1.2.0."""
    mod = tmp_path / "engine_pkg" / "sub" / "mod.py"
    mod.parent.mkdir(parents=True)
    (tmp_path / "engine_pkg" / "__init__.py").write_text("raise RuntimeError('never run')\n")
    (tmp_path / "engine_pkg" / "sub" / "__init__.py").write_text("raise RuntimeError('nor this')\n")
    mod.write_text(textwrap.dedent(SOURCE))
    info = tmp_path / "engine_pkg-1.2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: engine-pkg\nVersion: 1.2.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return mod


def test_a_module_is_found_without_importing_it_or_its_packages(package):
    assert source_file("engine_pkg.sub.mod") == package
    assert source_file("engine_pkg.sub.gone") is None
    assert source_file("no_such_top_level.mod") is None
    assert not [m for m in sys.modules if m.startswith("engine_pkg")]


@pytest.mark.parametrize(("name", "shape"), [
    ("plain", "(a, b=2)"),
    ("only", "(a, /, b, *, c=None)"),
    ("waits", "(x=2 + 3)"),
    ("Encoder.open", "(cls, path, *, fps, quality=None)"),
    ("Encoder.__init__", "(self, *, width, height)"),
    ("Encoder", None),  # a class is not a function
    ("value", None),
    ("Encoder.close", None),
    ("gone", None),
])  # fmt: skip
def test_a_targets_parameters_as_its_source_spells_them(package, name, shape):
    assert signature(package, name) == shape


def test_a_file_that_does_not_parse_has_no_target(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    assert signature(broken, "f") is None
    assert signature(tmp_path / "missing.py", "f") is None


ENGINE = Engine("EnginePkg", "engine-pkg", ("1.1.0", "1.2.0"))
OPEN = Target("engine_pkg.sub.mod", "Encoder.open", {
    "1.1.0": "(cls, path, *, fps)", "1.2.0": "(cls, path, *, fps, quality=None)"})  # fmt: skip
PLAIN = Target("engine_pkg.sub.mod", "plain", {"1.2.0": "(a, b=2)"})
LATER = Target("engine_pkg.sub.mod", "later", {"1.3.0": "()"})  # not at 1.2.0 by design


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    """Each test's warnings said afresh (they are said once per process)."""
    monkeypatch.setattr("framewire.integrations._switch._said", set())


def test_a_verified_version_allows_its_targets_as_verified(package, caplog):
    probe = Probe(ENGINE)
    assert (probe.version, probe.verified) == ("1.2.0", True)
    assert probe.wanted(OPEN) and not probe.wanted(LATER)
    with caplog.at_level(logging.WARNING, logger="framewire.integrations"):
        assert probe.allows((OPEN, PLAIN))
    assert said(caplog) == []


def test_a_missing_or_different_target_is_refused_with_one_warning(package, caplog):
    other = Target(OPEN.module, OPEN.name, {"1.2.0": "(cls, path, *, fps)"})
    gone = Target(OPEN.module, "vanished", {"1.2.0": "()"})
    probe = Probe(ENGINE)
    with caplog.at_level(logging.WARNING, logger="framewire.integrations"):
        assert not probe.allows((other, PLAIN))
        assert not probe.allows((gone,))
        assert not probe.allows((gone,))  # said once
    assert said(caplog) == [
        "framewire: EnginePkg 1.2.0: engine_pkg.sub.mod.Encoder.open has the parameters "
        "(cls, path, *, fps, quality=None), not the verified (cls, path, *, fps); its saves "
        "run EnginePkg's own code",
        "framewire: EnginePkg 1.2.0: engine_pkg.sub.mod.vanished is missing; its saves run "
        "EnginePkg's own code",
    ]


def test_a_version_outside_the_range_is_left_unless_asked(package, caplog, monkeypatch):
    newer = Engine("EnginePkg", "engine-pkg", ("1.0.0", "1.1.0"))
    probe = Probe(newer)
    assert not probe.verified and probe.wanted(LATER)
    with caplog.at_level(logging.WARNING, logger="framewire.integrations"):
        assert not probe.allows((OPEN,))
    assert said(caplog) == [
        "framewire: EnginePkg 1.2.0 is outside the versions verified (1.0.0-1.1.0): every save "
        "runs EnginePkg's own code (FRAMEWIRE_INTEGRATIONS_UNVERIFIED=1 routes the targets "
        "that probe as verified)"
    ]
    monkeypatch.setenv(_probe.UNVERIFIED_ENV, "1")
    asked = Probe(newer)
    assert asked.allows((OPEN,))  # its parameters are one of those verified
    assert not asked.allows((Target(OPEN.module, OPEN.name, {"1.0.0": "(cls, path)"}),))


def test_an_engine_not_installed_is_never_hooked(caplog):
    probe = Probe(Engine("Nothing", "no-such-distribution-here", ("1.0",)))
    assert probe.version is None and not probe.verified
    with caplog.at_level(logging.WARNING, logger="framewire.integrations"):
        assert not probe.allows((Target("no_such_top_level.mod", "f", {"1.0": "()"}),))
    assert any("Nothing (no version found) is outside" in m for m in said(caplog))
