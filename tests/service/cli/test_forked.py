"""A command run as a fork of the zygote (tests/support/cli.py) answers what a fresh
interpreter answers: exit status, stdout and stderr, for the CLI, for scripts and for
modules forked from the torch zygote (the engines' drivers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.cli import CLI, run_cli, run_to_end, start_process
from tests.support.processes import wait_gone
from tests.support.zygote import Shared, Zygote, torch_zygote, zygote

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


MODULE_REPORT = """import json, os, sys
print(json.dumps([sys.argv[1:], os.path.basename(sys.argv[0]), sys.path[0] == os.getcwd(),
                  sys.path.index(os.environ["PYTHONPATH"]), __name__, os.environ["CASE"],
                  sorted(m for m in sys.modules if m.partition(".")[0] in ("framewire", "mods"))]))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One site for the module's cases: they share its torch zygote (one per PYTHONPATH)."""
    return tmp_path_factory.mktemp("site")


@pytest.mark.parametrize(
    "body", [*ENDINGS.values(), MODULE_REPORT], ids=[*ENDINGS.keys(), "reports_its_start"]
)
def test_a_module_forked_from_the_torch_zygote_answers_as_a_fresh_one(
    tmp_path: Path, site: Path, body: str
) -> None:
    """What the engines' drivers are (tests/support/engine_site.py): ``python -m MODULE``
    in a site on PYTHONPATH, with variables of its own."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "__init__.py").write_text("")
    (tmp_path / "mods" / "m.py").write_text(body + "\n")
    env = {**os.environ, "PYTHONPATH": str(site), "CASE": "mine"}
    forks = torch_zygote(env)
    assert forks is not None and forks.can_start(env)
    argv = [sys.executable, "-m", "mods.m", "a", "b"]
    forked = run_to_end(argv, lambda stdio: start_process(
        argv, forks, ["a", "b"], stdio=stdio, env=env, cwd=tmp_path, module="mods.m"
    ), timeout=60)  # fmt: skip
    alone = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert forked.returncode == alone.returncode
    assert forked.stdout == alone.stdout
    if body.startswith("raise"):
        assert forked.stderr.splitlines()[-1] == alone.stderr.splitlines()[-1]
    else:
        assert forked.stderr == alone.stderr


HANDED_REPORT = """import os, subprocess, sys
sys.path.insert(0, os.getcwd())
from tests.support import zygote
seen = "import os; print(os.environ.get('FRAMEWIRE_TEST_ZYGOTE'))"
child = subprocess.run([sys.executable, "-c", seen], capture_output=True, text=True).stdout.strip()
handed = zygote._handed is not None
forks = zygote.zygote()
print(handed, forks is not None and forks.can_start(None), child, zygote._handed)
"""


def test_a_forked_script_forks_its_workers_from_the_zygote_it_was_handed(tmp_path: Path) -> None:
    """A benchmark's workers are forks of the zygote its fork was handed, not of a second
    zygote it would start (3 s of CPU); its own children do not see the handover."""
    script = tmp_path / "s.py"
    script.write_text(HANDED_REPORT)
    forked = run_cli(script=script, cwd=REPO, timeout=60)
    assert (forked.returncode, forked.stdout, forked.stderr) == (0, "True True None None\n", "")


def test_the_runs_zygote_serves_each_process_from_a_session_of_its_own(tmp_path: Path) -> None:
    """The zygote a run on several processes shares (tests/conftest.py): each connection
    gets a fork of it that starts, reaps and reports that process's children; ended,
    it leaves no socket behind."""
    shared = Shared("torch")
    script = tmp_path / "s.py"
    script.write_text("import os, sys; print(os.getppid()); sys.exit(3)\n")
    try:
        connected = [Zygote(shared=shared.path) for _ in range(2)]
        runs = [z.start(["a"], tmp_path / f"{i}.log", None, tmp_path, script=script)
                for i, z in enumerate(connected)]  # fmt: skip
        assert [run.wait(timeout=60) for run in runs] == [3, 3]
        sessions = {int((tmp_path / f"{i}.log").read_text()) for i in range(2)}
        assert len(sessions) == 2  # one each
        for session in sessions:
            stat = Path(f"/proc/{session}/stat").read_text()
            assert int(stat.rpartition(")")[2].split()[1]) == shared.pid  # forks of it
        for z in connected:
            z.close()
        wait_gone(sessions)  # each ends with its connection, and is reaped
    finally:
        code = shared.stop()
    assert code == 0
    assert not Path(shared.path).parent.exists()
