"""Mutations of the product, one module each with an ``apply()``: tests/test_mutants.py
runs the tests that claim to catch each one with it applied in every Python process of
that run (pytest, the workers, their zygote, the command line) through a sitecustomize
first on PYTHONPATH, and they must fail."""

from __future__ import annotations

from pathlib import Path


def sitecustomize(name: str, where: Path) -> Path:
    """A sitecustomize in ``where`` that applies mutant ``name``; returns ``where``."""
    (where / "sitecustomize.py").write_text(
        f"from tests.support.mutants import {name}\n\n{name}.apply()\n"
    )
    return where
