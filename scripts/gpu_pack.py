"""Pack what scripts/gpu-check needs on the lent GPU host and its image lacks.

    scripts/gpu-pack [DIR]        (DIR defaults to .gpu-pack, which git ignores)

That host's python3 is CPython 3.12 on x86-64 Linux with torch (CUDA), numpy, httpx,
imageio, pytest and more, but without the worker's web stack, pydantic or
imageio-ffmpeg, and it reaches no package registry. This downloads their cp312
manylinux wheels at the versions this checkout's .venv runs (so the GPU run tests
what the CPU suite tests), follows their requirements down to what the host has,
and moves imageio-ffmpeg's ffmpeg out of its wheel into ``ffmpeg.xz`` (the binary
alone is most of what travels: x86 branch conversion then LZMA2 preset 2, in one xz
stream per part compressed on every core; ``lzma.decompress`` reads them as one).
PyAV is left out (35 MB): the worker runs without it there, unvalidated.
``manifest.json`` lists every file with its sha256. The compressed ffmpeg is kept in
``~/.cache/framewire/gpu-pack`` (``$XDG_CACHE_HOME``), keyed by the binary's sha256 and
the filters: a later pack of the same binary reuses it after checking it.

What travels to the host is the git tree plus carried folders, 64 MiB in all: the
total is printed with the tree's size and the pack fails above it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parents[1]
CAP = 64 << 20  # bytes that may travel: tree plus carried folders
MIB = 1 << 20
XZ_FILTERS = [{"id": lzma.FILTER_X86}, {"id": lzma.FILTER_LZMA2, "preset": 2}]
# What the worker, the client and the CUDA tests import that the host lacks. Their
# requirements are followed. typing-extensions is on the host, but pydantic needs a
# newer one than an older image may hold, and it is 45 kB.
ROOTS = ["fastapi", "uvicorn", "pydantic-settings", "imageio-ffmpeg", "typing-extensions"]
# On the host already (its package list): requirements met there are not packed.
THERE = {
    "annotated-doc", "anyio", "certifi", "click", "h11", "httpcore", "httpx", "idna",
    "imageio", "numba", "numpy", "packaging", "pillow", "prometheus-client", "pytest",
    "rich", "torch", "uvloop",
}  # fmt: skip
PLATFORMS = [
    "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
    "manylinux2014_x86_64", "manylinux1_x86_64",
]  # fmt: skip
# The host's interpreter, for the requirements' markers.
MARKERS = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "sys_platform": "linux",
    "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "extra": "",
}  # fmt: skip
FFMPEG_IN_WHEEL = re.compile(r"imageio_ffmpeg/binaries/ffmpeg-linux-x86_64[^/]*$")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def download(pins: dict[str, str], dest: Path) -> dict[str, Path]:
    """The cp312 manylinux x86_64 wheels (or pure ones) of ``name==version`` for each of
    ``pins``, in one pip run: name -> wheel."""
    before = set(dest.iterdir())
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
         "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
         *platforms, "--dest", str(dest), *(f"{n}=={v}" for n, v in pins.items())],
        check=True,
    )  # fmt: skip
    wheels = {
        canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in set(dest.iterdir()) - before
    }
    assert wheels.keys() == pins.keys(), (sorted(wheels), sorted(pins))
    return wheels


def requirements(name: str) -> list[Requirement]:
    """What the version of ``name`` installed here requires on the host (extras and other
    markers left out): the same Requires-Dist as its wheel for the host, which is
    checked where it is installed offline (pip refuses a wheel whose requirement is
    not in the pack)."""
    found = []
    for line in importlib.metadata.requires(name) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(MARKERS):
            found.append(req)
    return found


def installed(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"gpu-pack: {name} is not installed here: run scripts/bootstrap")


def resolve(dest: Path) -> dict[str, tuple[str, Path]]:
    """Download ROOTS and what they require, down to THERE: name -> (version, wheel).
    The versions installed here, their requirements read from their metadata: one pip
    run for all (each run costs a second or two of CPU)."""
    versions: dict[str, str] = {}
    wanted: list[Requirement] = [Requirement(n) for n in ROOTS]
    while wanted:
        req = wanted.pop()
        name = canonicalize_name(req.name)
        if name in THERE:
            continue
        if name not in versions:
            versions[name] = installed(name)
            wanted += requirements(name)
        if not req.specifier.contains(versions[name], prereleases=True):
            sys.exit(f"gpu-pack: {req} is wanted, this checkout runs {name} {versions[name]}")
    wheels = download(dict(sorted(versions.items())), dest)
    return {n: (versions[n], w) for n, w in wheels.items()}


def compress(raw: bytes) -> bytes:
    """``raw`` as concatenated xz streams, one per core. The x86 filter makes call
    targets position-independent. On ffmpeg 9.0.2 (164.7 MiB), over 2 cores: preset 2
    gives 52.1 MiB for 14 s of CPU, preset 6 46.7 MiB for 57 s, preset 9 without the
    filter 46.2 MiB for 90 s (one run; preset 2 took 31 s in another: the machine's
    speed varies). The pack fits 64 MiB either way; the time is paid once
    per binary (``compressed`` keeps the result), the 5 MiB on every copy to the host."""
    parts = max(1, min(os.cpu_count() or 1, 8))
    step = -(-len(raw) // parts)
    pieces = [raw[i : i + step] for i in range(0, len(raw), step)]
    with ThreadPoolExecutor(len(pieces)) as pool:  # lzma lets go of the GIL while it works
        return b"".join(pool.map(lambda piece: lzma.compress(piece, filters=XZ_FILTERS), pieces))


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "framewire"


def compressed(raw: bytes, digest: str) -> tuple[bytes, bool]:
    """``compress(raw)``, from the cache when an earlier pack compressed the same binary
    with the same filters: (the xz bytes, whether they came from the cache). A cached
    file is named after its own sha256 too, and used only if its bytes still hash to
    that name (a tenth of a second, where decompressing it to check took seconds); what
    it decompresses to was checked as it was made, and gpu-check checks it again
    against the manifest. The cache is written whole or not at all."""
    filters = hashlib.sha256(repr(XZ_FILTERS).encode()).hexdigest()[:12]
    folder = cache_dir() / "gpu-pack"
    stem = f"ffmpeg-{digest}-{filters}"
    kept = sorted(folder.glob(f"{stem}-*.xz"))
    for cached in kept:
        try:
            xz = cached.read_bytes()
        except OSError:
            continue
        if cached.name == f"{stem}-{hashlib.sha256(xz).hexdigest()[:16]}.xz":
            return xz, True
    xz = compress(raw)  # none yet, or unusable: compressed afresh and written over
    cached = folder / f"{stem}-{hashlib.sha256(xz).hexdigest()[:16]}.xz"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, delete=False) as tmp:
            tmp.write(xz)
        os.replace(tmp.name, cached)
        for stale in [*kept, folder / f"{stem}.xz"]:  # and one named as before the hash
            if stale != cached:
                stale.unlink(missing_ok=True)
    except OSError as exc:
        print(f"gpu-pack: the cache is not written ({exc})", file=sys.stderr)
    return xz, False


def split_ffmpeg(wheel: Path, dest: Path) -> dict[str, str | int]:
    """Rewrite imageio-ffmpeg's wheel without its ffmpeg (its RECORD line goes too) and
    write that binary xz-compressed beside it."""
    with zipfile.ZipFile(wheel) as z:
        [binary] = [n for n in z.namelist() if FFMPEG_IN_WHEEL.search(n)]
        raw = z.read(binary)
        stripped = wheel.with_suffix(".tmp")
        with zipfile.ZipFile(stripped, "w", zipfile.ZIP_DEFLATED) as out:
            for item in z.infolist():
                if item.filename == binary:
                    continue  # not read again: inflating it is most of a pack's CPU
                data = z.read(item)
                if item.filename.endswith(".dist-info/RECORD"):
                    kept = [r for r in data.decode().splitlines() if not r.startswith(binary + ",")]
                    data = ("\n".join(kept) + "\n").encode()
                out.writestr(item, data)
    stripped.replace(wheel)
    digest = hashlib.sha256(raw).hexdigest()
    data, cached = compressed(raw, digest)
    xz = dest / "ffmpeg.xz"
    xz.write_bytes(data)
    return {
        "file": xz.name,
        "name": Path(binary).name,  # unpacked where the wheel had it
        "bytes": len(raw),
        "sha256": digest,
        "xz_bytes": xz.stat().st_size,
        "from_cache": cached,
    }


def tree_bytes() -> int:
    """Bytes of what travels without carrying: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    paths = (REPO / p.decode() for p in listed if p)
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def fresh(dest: Path) -> None:
    """An empty ``dest``: a previous pack is replaced, anything else is left alone."""
    if dest.exists() and any(dest.iterdir()):
        if not (dest / "manifest.json").is_file():
            sys.exit(f"gpu-pack: {dest} holds files that are not a pack: choose another folder")
        shutil.rmtree(dest)
    dest.mkdir(parents=True, exist_ok=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", nargs="?", type=Path, default=REPO / ".gpu-pack")
    args = parser.parse_args()
    dest: Path = args.dest.resolve()
    fresh(dest)
    with tempfile.TemporaryDirectory(dir=dest) as scratch:
        packed = resolve(Path(scratch))
        ffmpeg = split_ffmpeg(packed["imageio-ffmpeg"][1], dest)
        wheels: list[dict[str, str | int]] = []
        for name, (version, wheel) in sorted(packed.items()):
            moved = wheel.replace(dest / wheel.name)
            wheels.append({"name": name, "version": version, "file": moved.name,
                           "bytes": moved.stat().st_size, "sha256": sha256(moved)})  # fmt: skip
    total = sum(int(w["bytes"]) for w in wheels) + int(ffmpeg["xz_bytes"])
    manifest = {
        "python": "cp312", "platform": "manylinux x86_64", "wheels": wheels, "ffmpeg": ffmpeg,
        "on_the_host": sorted(THERE), "total_bytes": total,
    }  # fmt: skip
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    total += (dest / "manifest.json").stat().st_size
    tree = tree_bytes()
    for w in wheels:
        print(f"gpu-pack: {w['file']:<72} {int(w['bytes']) / MIB:7.2f} MiB")
    xz, raw = int(ffmpeg["xz_bytes"]), int(ffmpeg["bytes"])
    reused = ", from the cache" if ffmpeg["from_cache"] else ""
    print(f"gpu-pack: ffmpeg.xz ({ffmpeg['name']}, {raw / MIB:.2f} MiB{reused}) {xz / MIB:.2f} MiB")
    print(f"gpu-pack: {dest}: {total / MIB:.2f} MiB packed + {tree / MIB:.2f} MiB tree = "
          f"{(total + tree) / MIB:.2f} MiB of {CAP / MIB:.0f} MiB")  # fmt: skip
    if total + tree > CAP:
        print("gpu-pack: over the cap: this cannot travel", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
