"""The fixtures every suite shares; the helpers behind them live in tests.support."""

from __future__ import annotations

import itertools
import os
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.support.order import in_order
from tests.support.processes import child_pids, framewire_temps, open_memfds
from tests.support.real import unavailable
from tests.support.worker import FORK, Worker, Workers
from tests.support.zygote import Shared, share, start_variables

if TYPE_CHECKING:
    from tests.support.segments import Segments

# tests/image/ builds the container image and runs it under podman (minutes): scripts/test-image
# runs it, after scripts/test in .ci/run; a selection of scripts/test never does.
collect_ignore = [] if os.environ.get("FRAMEWIRE_IMAGE_TESTS") == "1" else ["image"]

# What this process's interpreter started with, of the variables one reads as it starts:
# its zygote's too. A worker asked for with other values is started afresh (2-4 s of CPU).
STARTED_WITH = start_variables()

# A run on several processes (pytest-xdist) preloads the worker's zygote once: the
# controller starts it and hands each process its socket (tests/support/zygote.py). Not
# under tests.support.cpu_accounting, which counts a process's workers in its own cgroup.
SHARED_ZYGOTE = "framewire_zygote"
_shared = pytest.StashKey[Shared]()


def pytest_configure(config: pytest.Config) -> None:
    if runs_tests(config):
        import torch  # here, not as this file loads (runs_tests)

        # One intra-op thread for the tests' own tensors (clips, oracles), as the worker
        # gives its conversion (single_threaded_conversion): the suite's processes already
        # fill every core, and a pool of two spun on each small op (a 6-frame clip took
        # 50 ms of CPU, not 1 ms).
        torch.set_num_threads(1)
    handed = getattr(config, "workerinput", {}).get(SHARED_ZYGOTE)
    if handed:
        share(handed)
    elif (
        FORK
        and not hasattr(config, "workerinput")
        and config.getoption("numprocesses", None)
        and not config.pluginmanager.has_plugin("tests.support.cpu_accounting")
    ):
        try:
            config.stash[_shared] = Shared()
        except RuntimeError as exc:  # each process then starts its own
            warnings.warn(f"no zygote for the whole run: {exc}", stacklevel=1)


def runs_tests(config: pytest.Config) -> bool:
    """Whether this process runs tests: not the controller of a parallel run (pytest-xdist),
    which only hands them out; it imports no torch (2 CPU-s before any process starts)."""
    return hasattr(config, "workerinput") or not config.getoption("numprocesses", None)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:  # pytest-xdist's: a process about to start
    shared = node.config.stash.get(_shared, None)
    if shared is not None:
        node.workerinput[SHARED_ZYGOTE] = shared.path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # a process of a parallel run: every one alike
        in_order(items)


def pytest_unconfigure(config: pytest.Config) -> None:
    shared = config.stash.get(_shared, None)
    if shared is not None:
        shared.stop()


@pytest.fixture
def as_root() -> None:
    """For tests that act as other uids (tests.support.real.needs_root)."""
    if os.geteuid() != 0:
        unavailable("acting as another uid needs root")


@pytest.fixture(scope="session")
def wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One second of a 440 Hz tone, mono, 22050 Hz."""
    from tests.support.media import FFMPEG

    path = tmp_path_factory.mktemp("audio") / "tone.wav"
    subprocess.run(
        [FFMPEG, "-v", "error", "-f", "lavfi", "-i", "sine=frequency=440:duration=1",
         "-ac", "1", "-ar", "22050", str(path)],
        check=True,
    )  # fmt: skip
    return path


@pytest.fixture
def segments() -> Iterator[Segments]:
    """POSIX shm segments for this test, unlinked after it."""
    from tests.support.segments import Segments

    made = Segments()
    yield made
    made.remove()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    """Start workers for this test (``workers.start(*flags)``); stopped after it, exit 0."""
    count = itertools.count()
    started = Workers(lambda: tmp_path / f"worker{next(count)}")
    yield started
    started.stop_all()


@pytest.fixture(scope="module")
def worker(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    """The module's worker, started with the module's ``WORKER_ARGS`` (flags of
    ``framewire serve``) and shared by its tests; it must stop with status 0."""
    args = tuple(getattr(request.module, "WORKER_ARGS", ()))
    started = Workers(lambda: tmp_path_factory.mktemp("worker"))
    yield started.start(*args)
    started.stop_all()


@pytest.fixture(autouse=True)
def no_leaks(tmp_path: Path) -> Iterator[None]:
    """Every test: no ffmpeg child, no temp output, no memfd left behind, and the variables
    an interpreter reads as it starts as they were (else every later worker of this
    process would start afresh, silently: an import that sets one, say)."""
    before_children, before_memfds = child_pids(), open_memfds()
    yield
    assert child_pids() - before_children == set(), "child processes left running"
    assert framewire_temps(tmp_path) == [], "temp outputs left behind"
    assert open_memfds() <= before_memfds, "memfds left open"
    now = start_variables()
    changed = sorted(k for k in {*now, *STARTED_WITH} if now.get(k) != STARTED_WITH.get(k))
    assert not changed, f"os.environ's start variables changed: {changed}"
