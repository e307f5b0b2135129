"""Running a benchmark script as the tests of tests/benchmarks/ do, and checking its figures.

Wall times are printed, never asserted; what is asserted is that each script
finishes, prints its table, finds framewire's bytes equal to its peers' (each
exits 1 otherwise) and draws its figures: PNG files that decode to an image.
The scripts are spread over several test files so that a parallel suite runs them
side by side.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tests.support import REPO
from tests.support.cli import run_cli


def bench(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/SCRIPT ARGS`` in the checkout (a fork of the zygote where one
    can start: tests/support/cli.py)."""
    return run_cli(*args, script=REPO / "benchmarks" / script, timeout=timeout, cwd=REPO)


def bench_json(
    tmp_path: Path, script: str, *args: str, figures: tuple[str, ...] = (), timeout: float = 240
) -> tuple[subprocess.CompletedProcess[str], Any]:
    """Runs ``script`` with ``--json`` (and ``--figures`` where it draws ``figures``), checks
    that it finished and drew exactly those; its output and the JSON it wrote."""
    out = tmp_path / f"{Path(script).stem}.json"
    drawn = ("--figures", str(tmp_path / "figures")) if figures else ()
    r = bench(script, *args, "--json", str(out), *drawn, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    if figures:
        assert_figures(tmp_path / "figures", *figures)
    return r, json.loads(out.read_text())


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_figures(directory: Path, *names: str) -> None:
    """Exactly these PNGs were written, and each decodes to a picture of some size."""
    import matplotlib.image

    assert sorted(p.name for p in directory.iterdir()) == sorted(names)
    for name in names:
        path = directory / name
        assert path.read_bytes()[:8] == PNG_SIGNATURE, name
        pixels = matplotlib.image.imread(path)
        assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 300, pixels.shape
        assert pixels.std() > 0, f"{name} is blank"
