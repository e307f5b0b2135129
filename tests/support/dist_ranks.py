"""A gloo group of ranks calling decode_reference_shared, scenario after scenario.

    python -m tests.support.dist_ranks CONFIG.json   (or ``run_ranks`` from a test)

CONFIG: {"world": 4, "store": path, "out": dir, "scenarios": [{"name", "params",
"sockets": [per rank], "paths": [per rank]}]}. Each rank writes out/rank{N}.json:
per scenario, its outcome (sha256 of the frames and their source, or the error's
class, code and message) and how long the call took. Run in its own process
(and session) so a test can time it out and kill every rank at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO


def run_ranks(config: dict, tmp_path: Path, timeout: float = 120) -> list[dict]:
    """Run the group to the end, or kill all of it at ``timeout`` (a hang fails the test)."""
    config_path = tmp_path / "ranks.json"
    config_path.write_text(json.dumps(config))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.dist_ranks", str(config_path)],
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the rank group did not finish within {timeout} s")
    assert proc.returncode == 0, out
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(config["world"])]


def rank_main(rank: int, config: dict[str, Any]) -> None:
    import torch.distributed as dist
    from framewire.client import Client, FramewireError
    from framewire.client.distributed import decode_reference_shared

    dist.init_process_group(
        "gloo",
        init_method=f"file://{config['store']}",
        rank=rank,
        world_size=config["world"],
        timeout=timedelta(seconds=30),  # a rank left behind fails instead of hanging
    )
    results: dict[str, Any] = {}
    try:
        for scenario in config["scenarios"]:
            started = time.monotonic()
            with Client(fd_socket=scenario["sockets"][rank], timeout=60) as client:
                try:
                    with decode_reference_shared(
                        scenario["paths"][rank], client=client, **scenario["params"]
                    ) as ref:
                        outcome = {
                            "ok": True,
                            "sha256": hashlib.sha256(ref.frames).hexdigest(),
                            "source": ref.source,
                        }
                except FramewireError as exc:
                    outcome = {
                        "ok": False,
                        "error": type(exc).__name__,
                        "code": exc.code,
                        "message": exc.message,
                    }
            outcome["seconds"] = time.monotonic() - started
            results[scenario["name"]] = outcome
            dist.barrier()  # the next scenario starts together
    finally:
        Path(config["out"], f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def main() -> None:
    import framewire.client.distributed  # noqa: F401  (imported once, before the forks)
    import torch.distributed  # noqa: F401
    import torch.multiprocessing as mp

    config = json.loads(Path(sys.argv[1]).read_text())
    # Forked, not spawned: each rank is a process of its own as under torchrun, without
    # an interpreter's start and torch's import (2.5 s of CPU) apiece. No thread runs here
    # yet, and the process group is made in each rank.
    mp.start_processes(rank_main, args=(config,), nprocs=config["world"], join=True,
                       start_method="fork")  # fmt: skip


if __name__ == "__main__":
    main()
