"""A newcomer's first run, as the README gives it, from a fresh copy of the checkout:
``scripts/serve`` in the background, then the rest of the README's first-run commands and
its client lines against that worker, then SIGTERM. The commands and the lines are read
from README.md, so the README cannot drift from what works."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.worker import free_port

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def section_block(text: str, heading: str, lang: str) -> str:
    """The first ``lang`` code block under ``heading``."""
    section = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(rf"```{lang}\n(.*?)```", section, re.DOTALL)
    assert found is not None, f"no {lang} block under {heading}"
    return found.group(1)


def commands(block: str) -> list[list[str]]:
    """Each line's command, its comment left out."""
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def fresh_copy(dest: Path) -> Path:
    """The checkout's tracked files (as a clone has them), with its .venv: set up as
    ``scripts/bootstrap`` leaves it, so the copy's own bootstrap is a no-op."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        src, dst = ROOT / name, dest / name
        if src.is_symlink() or not src.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    (dest / ".venv").symlink_to(ROOT / ".venv")
    return dest


def test_the_readme_first_run_works_in_its_order(tmp_path):
    text = README.read_text()
    first_run = commands(section_block(text, "## First run", "bash"))
    assert first_run[0] == ["scripts/serve"], first_run
    snippet = section_block(text, "## The client in ten lines", "python")
    checkout = fresh_copy(tmp_path / "checkout")
    assert not (checkout / "outputs").exists() and not (checkout / "inputs").exists()
    # Its own port and runtime directory: the suite's other workers run beside it.
    port = free_port()
    env = os.environ | {
        "FRAMEWIRE_PORT": str(port),
        "FRAMEWIRE_URL": f"http://127.0.0.1:{port}",
        "XDG_RUNTIME_DIR": str(tmp_path / "run"),
    }
    (tmp_path / "run").mkdir(mode=0o700)
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        serve = subprocess.Popen(first_run[0], cwd=checkout, env=env, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            assert serve.poll() is None, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        started = log.read_text()
        assert f"outputs go under {checkout / 'outputs'}" in started, started
        assert "output_root_missing" not in started
        for command in first_run[1:]:
            done = subprocess.run(command, cwd=checkout, env=env, capture_output=True,
                                  text=True, timeout=300)  # fmt: skip
            assert done.returncode == 0, (command, done.stdout, done.stderr)
        client = subprocess.run([sys.executable, "-c", snippet], cwd=checkout, env=env,
                                capture_output=True, text=True, timeout=300)  # fmt: skip
        assert client.returncode == 0, (client.stderr[:3000], log.read_text()[-3000:])
        assert client.stdout.strip() == str(checkout / "outputs" / "clips" / "a.mp4")
        for name in ("a.mp4", "b.mp4"):
            assert (checkout / "outputs" / "clips" / name).stat().st_size > 0
    finally:
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(timeout=60)
    assert code == 0, log.read_text()[-3000:]
    gone = subprocess.run(["pgrep", "-s", str(serve.pid)], capture_output=True)
    assert gone.returncode == 1, gone.stdout  # nothing of its session left running
