"""The engines' own code at their own pins, installed apart from the test environment.

Each engine's site is a directory of wheels installed ``--no-deps`` with
``pip --target`` (made once per machine and interpreter under
``~/.cache/framewire-tests/engines``, a new one when its pins change; a fresh
clone reuses it): the engine's package, and the media packages it pins, which shadow
the test environment's when the site comes first on ``PYTHONPATH``. What the
engines import beyond that comes from the test environment (torch, numpy,
scipy), or is stubbed by the engine's driver (tests/support/engine_*.py) where
it would import a GPU runtime.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.support import CACHE, REPO

if TYPE_CHECKING:  # the drivers import this module: nothing of the suite's at run time
    from tests.support.zygote import Forked

# sglang[diffusion] 0.5.23 pins imageio-ffmpeg 0.5.1 (ffmpeg 4.2.2) and imageio 2.36.0;
# its platform module needs psutil.
PINS = {
    "sglang": ["sglang==0.5.23", "imageio-ffmpeg==0.5.1", "imageio==2.36.0", "psutil"],
    "vllm-omni": ["vllm-omni==0.30.0"],
    # vLLM-omni beside another PyAV than the worker's (SGLang's pin): another encoder.
    "vllm-omni-av16": ["vllm-omni==0.30.0", "av==16.1.0"],
}
ROOT = CACHE / "engines"


def engine_site(engine: str) -> Path:
    """The site directory of ``engine``'s pins (made on first use; a lock keeps the
    suite's processes from making it twice)."""
    pins = PINS[engine]
    # Its wheels (PyAV's, psutil's) are the interpreter's: one site per interpreter too.
    tag = hashlib.sha256("\n".join([sys.base_prefix, sys.version, *pins]).encode()).hexdigest()[:12]
    site = ROOT / f"{engine}-{tag}"
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / f"{engine}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (site / ".complete").exists():
            shutil.rmtree(site, ignore_errors=True)
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                 "--no-deps", "--no-compile", "--target", str(site), *pins],
                check=True, stdout=subprocess.DEVNULL,
            )  # fmt: skip
            (site / ".complete").touch()
    return site


def engine_ffmpeg(site: Path) -> Path:
    """The ffmpeg binary of the imageio-ffmpeg the site pins."""
    [exe] = (site / "imageio_ffmpeg" / "binaries").glob("ffmpeg-*")
    return exe


def engine_env(site: Path, **extra: str) -> dict[str, str]:
    """The environment of an engine process: its site first on the path, no
    integration unless ``extra`` names one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FRAMEWIRE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    env.update(extra)
    return env


def start_engine(
    site: Path, driver: str, *args: str, stdio: tuple[str, str, str], **env: str
) -> Forked | subprocess.Popen[bytes]:
    """``python -m tests.support.<driver> ARGS`` running in the engine's environment (a fork
    of a zygote there that has imported torch and no framewire, as tests/support/zygote.py can), its
    descriptors 0, 1 and 2 opened from ``stdio``."""
    from tests.support.cli import start_process  # not in the drivers: they import this
    from tests.support.worker import FORK
    from tests.support.zygote import torch_zygote

    full = engine_env(site, **env)
    forks = torch_zygote(full) if FORK else None
    return start_process(_argv(driver, args), forks, list(args), stdio=stdio, env=full, cwd=REPO,
                         module=f"tests.support.{driver}")  # fmt: skip


def _argv(driver: str, args: tuple[str, ...]) -> list[str]:
    """The fresh interpreter's command line for ``driver``."""
    return [sys.executable, "-m", f"tests.support.{driver}", *args]


def run_engine(site: Path, driver: str, *args: str, **env: str) -> dict[str, Any]:
    """``start_engine`` to its end: the JSON report its last line prints, with its stderr
    (the engine's log) as ``log``."""
    from tests.support.cli import run_to_end

    done = run_to_end(_argv(driver, args), lambda stdio: start_engine(
        site, driver, *args, stdio=stdio, **env
    ), timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    report["log"] = done.stderr
    return report


def enter_shells(package: str, names: tuple[str, ...]) -> None:
    """Enter ``names`` (``package``'s subpackages) as path-only shells: their modules
    import from the site on ``sys.path`` that holds ``package``, their ``__init__`` never
    runs (it would import the engine's whole runtime)."""
    import types

    [site] = [p for p in sys.path if (Path(p) / package).is_dir()][:1]
    for name in names:
        mod = types.ModuleType(name)
        mod.__path__ = [os.path.join(site, *name.split("."))]
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, mod)
