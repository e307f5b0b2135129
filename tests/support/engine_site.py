"""The engines' own code at their own pins, installed apart from the test environment.

Each engine's site is a directory of wheels installed ``--no-deps`` with
``pip --target`` (made once per machine and interpreter under
``~/.cache/framewire-tests/engines``, a new one when its pins change; a fresh
clone reuses it): the engine's package, and the media packages it pins, which shadow
the test environment's: a driver puts its sites first on its path (``use_sites``). What the
engines import beyond that comes from the test environment (torch, numpy,
scipy), or is stubbed by the engine's driver (tests/support/engine_*.py) where
it would import a GPU runtime.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.support import CACHE, REPO

if TYPE_CHECKING:  # the drivers import this module: nothing of the suite's at run time
    from tests.support.zygote import Forked

# The versions of each engine the integrations declare (integrations/*.py), oldest first.
VERSIONS = {
    "sglang": ("0.5.21", "0.5.22", "0.5.23"),
    "vllm-omni": ("0.26.0", "0.28.0", "0.30.0"),
    "diffusers": ("0.38.0", "0.39.0", "0.40.0", "0.41.0", "0.42.0", "0.42.1"),
}


def pins(engine: str, version: str | None = None) -> list[str]:
    """What the site of ``engine`` at ``version`` (the newest by default) holds: the
    engine, and what its own pins name where they shadow the test environment's.

    sglang[diffusion] 0.5.21-0.5.23 pin imageio-ffmpeg 0.5.1 (ffmpeg 4.2.2) and imageio
    2.36.0; its platform module needs psutil. vLLM-omni 0.26-0.30 and diffusers take
    ranges the test environment meets (PyAV, imageio-ffmpeg). ``vllm-omni-av16``:
    vLLM-omni beside another PyAV than the worker's (SGLang's pin), another encoder.
    ``pipeline``: what diffusers' text-to-video pipelines import beside diffusers
    (transformers, its tokenizers), for a pipeline built in code."""
    if engine == "vllm-omni-av16":
        return ["vllm-omni==0.30.0", "av==16.1.0"]
    if engine == "pipeline":
        return ["transformers==5.25.0", "tokenizers==0.23.3"]
    version = version or VERSIONS[engine][-1]
    if version not in VERSIONS[engine]:
        raise ValueError(f"{engine} {version} is not a version the integrations declare")
    if engine == "sglang":
        return [f"sglang=={version}", "imageio-ffmpeg==0.5.1", "imageio==2.36.0", "psutil"]
    return [f"{engine}=={version}"]


ROOT = CACHE / "engines"


def engine_site(engine: str, version: str | None = None) -> Path:
    """The site directory of ``engine``'s pins at ``version`` (made on first use; a lock
    keeps the suite's processes from making it twice)."""
    wanted = pins(engine, version)
    # Its wheels (PyAV's, psutil's) are the interpreter's: one site per interpreter too.
    key = "\n".join([sys.base_prefix, sys.version, *wanted])
    tag = hashlib.sha256(key.encode()).hexdigest()[:12]
    site = ROOT / f"{engine}-{tag}"
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / f"{engine}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (site / ".complete").exists():
            shutil.rmtree(site, ignore_errors=True)
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                 "--no-deps", "--no-compile", "--target", str(site), *wanted],
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


SITE_ENV = "FRAMEWIRE_TEST_SITE"
Sites = Path | Sequence[Path]


def driver_env(sites: Sites, **extra: str) -> dict[str, str]:
    """The environment of a driver in the engine's sites: the driver puts them first on
    its path itself (:func:`use_sites`), so every driver, whatever its sites, forks from
    one zygote (its start variables are the same)."""
    listed = [sites] if isinstance(sites, Path) else list(sites)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FRAMEWIRE_")}
    env["PYTHONPATH"] = str(REPO)
    env[SITE_ENV] = os.pathsep.join(str(s) for s in listed)
    env.update(extra)
    return env


def use_sites() -> None:
    """A driver's first step: its sites before everything on the path, as PYTHONPATH
    would put them (nothing of an engine's, nor of what the sites pin, is imported yet:
    the torch zygote imports neither)."""
    sites = [s for s in os.environ.get(SITE_ENV, "").split(os.pathsep) if s]
    sys.path[0:0] = sites
    importlib.invalidate_caches()


def start_engine(
    sites: Sites, driver: str, *args: str, stdio: tuple[str, str, str], **env: str
) -> Forked | subprocess.Popen[bytes]:
    """``python -m tests.support.<driver> ARGS`` running in the engine's environment (a fork
    of a zygote that has imported torch and no framewire, as tests/support/zygote.py can), its
    descriptors 0, 1 and 2 opened from ``stdio``."""
    from tests.support.cli import start_process  # not in the drivers: they import this
    from tests.support.worker import FORK
    from tests.support.zygote import torch_zygote

    full = driver_env(sites, **env)
    forks = torch_zygote(full) if FORK else None
    return start_process(_argv(driver, args), forks, list(args), stdio=stdio, env=full, cwd=REPO,
                         module=f"tests.support.{driver}")  # fmt: skip


def _argv(driver: str, args: tuple[str, ...]) -> list[str]:
    """The fresh interpreter's command line for ``driver``."""
    return [sys.executable, "-m", f"tests.support.{driver}", *args]


def run_engine(sites: Sites, driver: str, *args: str, **env: str) -> dict[str, Any]:
    """``start_engine`` to its end: the JSON report its last line prints, with its stderr
    (the engine's log) as ``log``."""
    from tests.support.cli import run_to_end

    done = run_to_end(_argv(driver, args), lambda stdio: start_engine(
        sites, driver, *args, stdio=stdio, **env
    ), timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    report["log"] = done.stderr
    return report


OVERLAY_ENV = "FRAMEWIRE_TEST_OVERLAY"


def enter_shells(package: str, names: tuple[str, ...]) -> None:
    """Enter ``names`` (``package``'s subpackages) as path-only shells: their modules
    import from the site on ``sys.path`` that holds ``package``, their ``__init__`` never
    runs (it would import the engine's whole runtime). A directory named by
    FRAMEWIRE_TEST_OVERLAY comes first in each: a module there (an engine's module with
    a function renamed, say) is imported instead of the site's."""
    import types

    [site] = [p for p in sys.path if (Path(p) / package).is_dir()][:1]
    overlay = os.environ.get(OVERLAY_ENV)
    for name in names:
        mod = types.ModuleType(name)
        mod.__path__ = [os.path.join(site, *name.split("."))]
        if overlay and os.path.isdir(os.path.join(overlay, *name.split("."))):
            mod.__path__.insert(0, os.path.join(overlay, *name.split(".")))
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, mod)


def overlay(root: Path, site: Path, module_file: str, *edits: tuple[str, str]) -> Path:
    """``root`` holding a copy of the site's ``module_file`` (a path in the site) with each
    edit (old, new) made, every one of them found: give it as FRAMEWIRE_TEST_OVERLAY."""
    text = (site / module_file).read_text()
    for old, new in edits:
        assert old in text, f"{module_file}: {old!r} not found"
        text = text.replace(old, new)
    (root / module_file).parent.mkdir(parents=True, exist_ok=True)
    (root / module_file).write_text(text)
    return root


def fake_version(root: Path, dist: str, version: str) -> Path:
    """A site holding only the metadata of ``dist`` at ``version``: first among a driver's
    sites, it is the version the engine's code reports (another release, say)."""
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    return root
