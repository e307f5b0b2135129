"""scripts/gpu-pack and scripts/gpu-check, proven without a GPU.

The lent GPU host runs CPython 3.12 with torch and the rest of its image, reaches no
registry, and takes 64 MiB: the pack is made here, installed and imported with a
Python 3.12 holding only what that image holds, offline. torch is the one stand-in
missing there: PyPI's cp312 torch is the CUDA build (500 MB, and it imports only with
GBs of NVIDIA wheels beside it), so that run stops at torch, exit 2, after the pack's
part; the same check with this checkout's CPU torch stops at "no CUDA device".
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support import CACHE, REPO
from tests.support.real import unavailable

CAP = 64 << 20
# The lent image's packages that the pack's part imports (its list in docs/deployment.md).
IMAGE = [
    "numpy", "httpx", "prometheus-client", "imageio", "rich", "pytest", "anyio", "h11",
    "click", "annotated-doc", "packaging",
]  # fmt: skip


def python312() -> str | None:
    """A Python 3.12 that runs: on the PATH, else pyenv's."""
    found = [shutil.which("python3.12")]
    found += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")))
    for exe in filter(None, found):
        ran = subprocess.run([exe, "--version"], capture_output=True, text=True)
        if ran.returncode == 0 and ran.stdout.startswith("Python 3.12"):
            return exe
    return None


def tree_bytes() -> int:
    """What travels of the checkout: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    return sum((REPO / p).stat().st_size for p in listed if (REPO / p).is_file())


def offline(cmd: list[str]) -> list[str]:
    """``cmd`` in a network namespace of its own (no network at all), where one can be made."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode == 0:
        return [unshare, "-rn", *cmd]
    return cmd


def gpu_check(python: str, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    cmd = offline([str(REPO / "scripts" / "gpu-check"), *flags, str(out)])
    return subprocess.run(
        cmd, env=env | {"PYTHON": python}, capture_output=True, text=True, timeout=300
    )


def test_without_a_gpu_the_check_stops_at_no_cuda_device(tmp_path):
    """This checkout's venv (CPU torch, everything installed), no pack: every import
    passes, then exit 2 with the reason; the log and the JSON are written."""
    ran = gpu_check(sys.executable, tmp_path / "out", "--no-pack")
    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert "gpu-check: imports ok" in ran.stdout
    assert "sees no CUDA device" in ran.stdout
    assert (tmp_path / "out" / "gpu-check.log").read_text() == ran.stdout
    summary = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert [(s["step"], s["rc"]) for s in summary["steps"]] == [("imports", 2)]
    assert summary["environment"]["torch"].startswith("2.")
    assert summary["cuda_tests"] is None and summary["benchmark"] is None


def host_image(python: str) -> Path:
    """A venv of ``python`` holding only what the lent host's image holds (torch aside).

    It stands in for the host and is not what is tested, so it is made once for each
    interpreter and package list and kept, like hls.js, under ~/.cache/framewire-tests
    (a venv and a pip install: about 10 s of CPU). It is made beside its place and
    renamed into it whole; the run never writes into it (gpu-check installs into --site).
    """
    version = subprocess.run([python, "--version"], capture_output=True, text=True, check=True)
    key = hashlib.sha256("\n".join([version.stdout.strip(), *IMAGE]).encode()).hexdigest()[:16]
    image = CACHE / f"gpu-host-image-{key}"
    exe = image / "bin" / "python"
    if exe.exists():
        ran = subprocess.run([exe, "--version"], capture_output=True, text=True)
        if ran.stdout == version.stdout:
            return image
        shutil.rmtree(image)  # its interpreter is gone or another: made again
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE, prefix=f".{image.name}-") as tmp:
        made = Path(tmp) / "image"
        subprocess.run([python, "-m", "venv", made], check=True, timeout=120)
        subprocess.run(
            [made / "bin" / "python", "-m", "pip", "install", "--quiet", "--no-compile", *IMAGE],
            check=True, timeout=600,
        )  # fmt: skip
        try:
            os.rename(made, image)
        except OSError:
            if not (image / "bin" / "python").exists():  # not another run's image: a failure
                raise
    return image


@pytest.mark.registry
def test_the_pack_fits_and_installs_offline_on_python312(tmp_path):
    py312 = python312()
    if py312 is None:
        unavailable("no Python 3.12 here (python3.12, or pyenv's): the host's interpreter")
    pack = tmp_path / "pack"
    with ThreadPoolExecutor(1) as pool:  # the host's stand-in is made while the pack is
        made_image = pool.submit(host_image, py312)
        made = subprocess.run(
            [REPO / "scripts" / "gpu-pack", pack], capture_output=True, text=True, timeout=900
        )
        image = made_image.result()
    assert made.returncode == 0, made.stdout + made.stderr
    manifest = json.loads((pack / "manifest.json").read_text())
    packed = {w["name"] for w in manifest["wheels"]}
    assert {"fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core",
            "pydantic-settings", "imageio-ffmpeg"} <= packed  # fmt: skip
    assert packed.isdisjoint({"av", "torch", "numpy", "anyio"})  # too big, or there
    core = next(w for w in manifest["wheels"] if w["name"] == "pydantic-core")
    assert "-cp312-cp312-manylinux" in core["file"] and core["file"].endswith("x86_64.whl")
    packed_bytes = sum(f.stat().st_size for f in pack.iterdir())
    tree = tree_bytes()
    assert packed_bytes + tree <= CAP
    assert f"{(packed_bytes + tree) / (1 << 20):.2f} MiB of 64 MiB" in made.stdout

    site = tmp_path / "site"
    ran = gpu_check(str(image / "bin" / "python"), tmp_path / "out", "--pack", str(pack),
                    "--site", str(site))  # fmt: skip
    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert "gpu-check: the client and the web stack import" in ran.stdout, ran.stdout
    assert "gpu-check: torch is not installed" in ran.stdout
    assert list(site.glob("pydantic_core/_pydantic_core.cpython-312-x86_64-linux-gnu.so"))
    ffmpeg = site / "imageio_ffmpeg" / "binaries" / manifest["ffmpeg"]["name"]
    assert f"at {ffmpeg}" in ran.stdout
    version = subprocess.run([ffmpeg, "-version"], capture_output=True, text=True, check=True)
    assert version.stdout.splitlines()[0] in ran.stdout
    summary = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    steps = [(s["step"], s["rc"]) for s in summary["steps"]]
    assert steps == [("install", 0), ("unpack", 0), ("imports", 2)]
    assert summary["environment"]["python"].startswith("3.12")


def test_the_packs_ffmpeg_is_compressed_once_per_binary(tmp_path, monkeypatch):
    """The xz of a binary is kept in the cache, named after its own sha256 too, and reused
    while its bytes hash to that name; a damaged one is compressed afresh and written over."""
    import importlib.util
    import lzma

    spec = importlib.util.spec_from_file_location("gpu_pack", REPO / "scripts" / "gpu_pack.py")
    assert spec and spec.loader
    pack = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pack)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    raw = os.urandom(1 << 16) * 4
    digest = hashlib.sha256(raw).hexdigest()
    first, cached = pack.compressed(raw, digest)
    assert not cached and lzma.decompress(first) == raw
    [kept] = (tmp_path / "framewire" / "gpu-pack").iterdir()
    assert digest in kept.name and kept.read_bytes() == first
    again, cached = pack.compressed(raw, digest)
    assert cached and again == first
    kept.write_bytes(first[: len(first) // 2])  # cut short, as by a full disk
    third, cached = pack.compressed(raw, digest)
    assert not cached and lzma.decompress(third) == raw and kept.read_bytes() == third
    assert [p.name for p in kept.parent.iterdir()] == [kept.name]  # no temp file left
