"""The Python steps of scripts/gpu-check: unpack ffmpeg, check the imports, sum up.

    python3 scripts/gpu_check.py unpack PACK SITE PATHFILE   ffmpeg.xz -> SITE's imageio_ffmpeg
    python3 scripts/gpu_check.py imports OUT [PACK]   exit 2: a dependency or no CUDA device
    python3 scripts/gpu_check.py summary OUT STEPS    OUT/gpu-check.json

Standard library only at the top: this runs first on a host that may lack the rest.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ENVIRONMENT = "environment.json"  # what ``imports`` found, for ``summary``; removed there


def unpack(pack: Path, site: Path, path_file: Path) -> int:
    """Put ffmpeg where imageio-ffmpeg's wheel had it, checked against the manifest;
    write its path into ``path_file``."""
    ffmpeg = json.loads((pack / "manifest.json").read_text())["ffmpeg"]
    target = site / "imageio_ffmpeg" / "binaries" / ffmpeg["name"]
    raw = lzma.decompress((pack / ffmpeg["file"]).read_bytes())
    if hashlib.sha256(raw).hexdigest() != ffmpeg["sha256"]:
        print(f"gpu-check: {pack / ffmpeg['file']} does not unpack to its manifest's ffmpeg")
        return 2
    target.write_bytes(raw)
    target.chmod(0o755)
    path_file.write_text(str(target))
    print(f"gpu-check: {target} ({len(raw)} bytes, sha256 as in the manifest)")
    return 0


def unmet(pack: Path) -> list[str]:
    """The packed distributions' requirements that what is importable here does not meet."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    problems = []
    for wheel in json.loads((pack / "manifest.json").read_text())["wheels"]:
        try:
            required = md.requires(wheel["name"]) or []
        except md.PackageNotFoundError:
            problems.append(f"{wheel['file']} is in the pack but not installed")
            continue
        for line in required:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                problems.append(f"{wheel['name']} needs {req}: not installed")
                continue
            if not req.specifier.contains(have, prereleases=True):
                problems.append(f"{wheel['name']} needs {req}: {have} is installed")
    return problems


def imports(out: Path, pack: Path | None) -> int:
    """What the pack brings and the client, with ffmpeg; then torch, the worker and the
    GPU (last, so that a host without one still shows that the rest is in place)."""
    found: dict[str, Any] = {"python": sys.version.split()[0]}
    (out / ENVIRONMENT).write_text(json.dumps(found))
    if pack is not None and (problems := unmet(pack)):
        print("gpu-check: " + "\ngpu-check: ".join(problems))
        return 2
    import fastapi
    import framewire.client._http  # the client's dependencies
    import imageio  # the tests' reference writer
    import imageio_ffmpeg
    import pydantic
    import pydantic_settings
    import uvicorn
    from framewire.core.media.process import resolve_ffmpeg

    ffmpeg = resolve_ffmpeg()
    if imageio_ffmpeg.get_ffmpeg_exe() != ffmpeg:  # the references and the worker: one binary
        print(f"gpu-check: imageio-ffmpeg runs {imageio_ffmpeg.get_ffmpeg_exe()}, not {ffmpeg}")
        return 2
    version = subprocess.run([ffmpeg, "-version"], capture_output=True, text=True, check=True)
    found["ffmpeg"] = version.stdout.splitlines()[0]
    for module in (fastapi, uvicorn, pydantic, pydantic_settings, imageio):
        found[module.__name__] = getattr(module, "__version__", None)
    (out / ENVIRONMENT).write_text(json.dumps(found))
    print(f"gpu-check: the client and the web stack import; {found['ffmpeg']} at {ffmpeg}")
    try:
        import torch
    except ImportError as exc:
        print(f"gpu-check: torch is not installed: {exc}")
        return 2
    import framewire.service._http.app  # the worker's dependencies  # noqa: F401
    import pytest
    from framewire.service._probe import pyav_build

    found |= {"torch": torch.__version__, "pytest": pytest.__version__, "pyav": pyav_build()}
    (out / ENVIRONMENT).write_text(json.dumps(found))
    print(f"gpu-check: imports ok (torch {torch.__version__})")
    if found["pyav"] is None:
        print("gpu-check: PyAV is not installed: output validation is off and the vllm-omni "
              "profile is not checked here (skipped, not failed)")  # fmt: skip
    if not torch.cuda.is_available():
        print(f"gpu-check: torch {torch.__version__} sees no CUDA device")
        return 2
    found |= {
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "driver": nvidia_driver(),
    }
    (out / ENVIRONMENT).write_text(json.dumps(found))
    print(f"gpu-check: torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{len(found['gpus'])} x {found['gpus'][0]}, driver {found['driver']}")  # fmt: skip
    return 0


def nvidia_driver() -> str | None:
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def tests(junit: Path) -> dict[str, Any] | None:
    """Counts and the failures of pytest's junit report, if it wrote one."""
    if not junit.is_file():
        return None
    root = ET.parse(junit).getroot()
    suite = root.find("testsuite") if root.tag == "testsuites" else root
    if suite is None:
        return None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return counts | {"seconds": float(suite.get("time", 0)), "failed": failed}


def summary(out: Path, steps: str) -> int:
    """OUT/gpu-check.json: the host, each step's exit status and seconds, the CUDA tests'
    counts and the benchmark's rows."""
    env_file, bench = out / ENVIRONMENT, out / "gpu_encode.json"
    result = {
        "environment": json.loads(env_file.read_text()) if env_file.is_file() else None,
        "steps": [
            {"step": name, "rc": int(rc), "seconds": int(s)}
            for name, rc, s in (item.split(":") for item in steps.split())
        ],
        "cuda_tests": tests(out / "cuda-tests.xml"),
        "benchmark": json.loads(bench.read_text()) if bench.is_file() else None,
    }
    env_file.unlink(missing_ok=True)
    (out / "gpu-check.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


def main(argv: list[str]) -> int:
    match argv:
        case ["unpack", pack, site, path_file]:
            return unpack(Path(pack), Path(site), Path(path_file))
        case ["imports", out, *pack]:
            return imports(Path(out), Path(pack[0]) if pack else None)
        case ["summary", out, steps]:
            return summary(Path(out), steps)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
