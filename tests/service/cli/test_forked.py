"""A command run as a fork of the zygote (tests/support/cli.py) answers what a fresh
interpreter answers: exit status, stdout and stderr, for the CLI and for scripts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import CLI, run_cli
from tests.support.zygote import zygote

ENDINGS = {
    "returns": "print('out', end='\\r'); print('done')",
    "exits_none": "import sys; print('x'); sys.exit()",
    "exits_text": "import sys; sys.exit('refused: a reason')",
    "exits_3": "import sys; print('err', file=sys.stderr); sys.exit(3)",
    "raises": "raise ValueError('boom')",
    "reads_argv_and_path": "import sys, os; print(sys.argv[1:], os.path.basename(sys.path[0]))",
}


def fresh(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("ending", ENDINGS.values(), ids=ENDINGS.keys())
def test_a_forked_script_answers_as_a_fresh_one(tmp_path: Path, ending: str) -> None:
    assert zygote() is not None  # else both runs below would be fresh ones
    folder = tmp_path / "scripts"
    folder.mkdir()
    script = folder / "s.py"
    script.write_text(ending + "\n")
    forked = run_cli("a", "b", script=script, timeout=60)
    alone = fresh([sys.executable, str(script), "a", "b"])
    assert forked.returncode == alone.returncode
    assert forked.stdout == alone.stdout
    if ending.startswith("raise"):  # the traceback names the frames that ran it
        assert forked.stderr.splitlines()[-1] == alone.stderr.splitlines()[-1]
    else:
        assert forked.stderr == alone.stderr


@pytest.mark.parametrize("args", [["--version"], ["encode"], ["info", "--cpu-slots", "0"]])
def test_the_forked_cli_answers_as_a_fresh_one(args: list[str]) -> None:
    forked, alone = run_cli(*args), fresh([*CLI, *args])
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        alone.returncode, alone.stdout, alone.stderr
    )  # fmt: skip
