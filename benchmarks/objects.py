"""Object storage benchmark: an output uploaded by the worker against boto3's upload_file.

    .venv/bin/python benchmarks/objects.py [--frames 120] [--width 1344 --height 768]
                                           [--big-mib 1024] [--repeat 3] [--json OUT]

moto's standalone S3 server runs on loopback (a real HTTP server speaking S3;
it keeps objects in memory, so its own speed bounds both columns alike). Two
rows, each measured in one run:

  output  the clip's MP4: a worker (warmed by one small upload) saves it to
          s3://bench/…; "framewire" is the
          result's ``upload_ms``, measured in the worker from the end of the
          encode (file validated in the spool) to the object complete; "boto3"
          is ``upload_file`` of the same bytes in a fresh process (its own
          threads, 8 MiB parts; median of --repeat). Extra memory: the worker's resident memory,
          sampled every 2 ms during the upload, above its level when the
          upload began.
  big     a file of --big-mib MiB (no video that large is encoded here): the
          worker's own upload code (``S3Store.upload``, its settings: 16 MiB
          parts, 4 in flight) in a fresh process, against ``upload_file`` in
          another, --repeat times each in alternating order (medians: moto slows
          as it fills). Extra memory: each process's peak resident memory (VmHWM,
          reset through /proc/self/clear_refs just before the upload: exact)
          above its level then.

The goal (DESIGN 5.6): framewire's upload no slower than boto3's usual one, and
its memory bounded by its parts in flight (32 MiB), not the file's size. Every
object's size, and the output's sha256, are checked against the file's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
import numpy as np  # noqa: E402
from encode import clip_chunk  # noqa: E402  (the shared clip generator)

from tests.support.objstore import KEY_ID, SECRET, moto_server, store_env  # noqa: E402

BUCKET = "bench"
MIB = 1 << 20


def _status_kib(pid: int | str, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(kind: str, path: str, key: str) -> None:
    """One upload in this fresh process; prints {wall_s, extra_bytes} as JSON."""
    import boto3

    size = os.path.getsize(path)
    if kind == "boto3":
        client = boto3.client("s3")
        client.head_bucket(Bucket=BUCKET)  # connection and credentials before the clock

        def upload() -> None:
            client.upload_file(path, BUCKET, key)
    else:
        from framewire.service._access.urls import parse_url
        from framewire.service._settings import Settings
        from framewire.service._store.owners import OwnedUrl
        from framewire.service._store.s3 import S3Store

        store = S3Store(Settings())
        store.client().head_bucket(Bucket=BUCKET)
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(8 * MIB):
                digest.update(block)
        fd = os.open(path, os.O_RDONLY)

        judged = parse_url(f"s3://{BUCKET}/{key}")
        url = OwnedUrl(judged.bucket, judged.key)  # a new object, as a request judges one

        def upload() -> None:
            store.upload(fd, size, digest.hexdigest(), url, threading.Event())

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _status_kib("self", "VmRSS")
    t0 = time.perf_counter()
    upload()
    wall = time.perf_counter() - t0
    extra = (_status_kib("self", "VmHWM") - base) * 1024
    print(json.dumps({"wall_s": wall, "extra_bytes": extra}))


def in_child(kind: str, path: Path, key: str, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", kind, str(path), key]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the {kind} upload failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class RssSampler:
    """A process's resident memory every 2 ms: (time.time(), bytes)."""

    def __init__(self, pid: int):
        self.pid, self.samples, self._stop = pid, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), _status_kib(self.pid, "VmRSS") * 1024))
            time.sleep(0.002)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def extra(self, t0: float, t1: float) -> int:
        before = [b for t, b in self.samples if t <= t0]
        during = [b for t, b in self.samples if t0 <= t <= t1]
        return max(during, default=0) - (before[-1] if before else during[0])


def output_row(root: Path, env: dict[str, str], args: argparse.Namespace, s3: Any) -> dict:
    from framewire.client import Client

    clip = np.ascontiguousarray(
        (clip_chunk(0, args.frames, args.height, args.width) * 255).astype(np.uint8)
    )  # (3, T, H, W) uint8: the worker converts nothing, x264 does the work
    clip = np.ascontiguousarray(clip.transpose(1, 2, 3, 0))
    from tests.support.worker import start_worker

    worker = start_worker(root, "--output-urls", f"s3://{BUCKET}/", env=env)
    try:
        with Client(worker.uds_url, timeout=600) as client:
            # Warm: the worker's store client, and its first connection, made before the clock.
            client.save_video(clip[:2, :64, :64], f"s3://{BUCKET}/warm.mp4", fps=24)
            with RssSampler(worker.pid) as rss:
                result = client.save_video(clip, f"s3://{BUCKET}/output.mp4", fps=24)
            local = client.save_video(clip, "output.mp4", fps=24)
    finally:
        worker.stop()
    end = result.timings.finished_at
    extra = rss.extra(end - result.timings.upload_ms / 1e3, end)
    path = worker.outputs / "output.mp4"
    body = s3.get_object(Bucket=BUCKET, Key="output.mp4")["Body"].read()
    same = hashlib.sha256(body).hexdigest() == result.sha256 == local.sha256
    theirs = in_child("boto3", path, "output-boto3.mp4", env)
    ok = same and s3.head_object(Bucket=BUCKET, Key="output-boto3.mp4")["ContentLength"] == len(
        body
    )
    return {"what": f"{args.frames}-frame {args.width}x{args.height} output", "bytes": len(body),
            "framewire_s": result.timings.upload_ms / 1e3, "boto3_s": theirs["wall_s"],
            "framewire_extra": extra, "boto3_extra": theirs["extra_bytes"], "same": ok}  # fmt: skip


def uploads(kind: str, path: Path, env: dict[str, str], s3: Any) -> tuple[dict, bool]:
    """One upload of ``path`` by ``kind`` in a fresh process; the object checked, then
    deleted (moto holds objects in memory)."""
    key = f"{kind}-{path.name}"
    run = in_child(kind, path, key, env)
    ok = s3.head_object(Bucket=BUCKET, Key=key)["ContentLength"] == path.stat().st_size
    s3.delete_object(Bucket=BUCKET, Key=key)
    return run, ok


def compared(path: Path, env: dict[str, str], s3: Any, repeat: int) -> dict:
    """Medians of ``repeat`` uploads each (alternating which goes first) and peak memory."""
    runs: dict[str, list[dict]] = {"framewire": [], "boto3": []}
    ok = True
    for i in range(repeat):
        order = ["framewire", "boto3"] if i % 2 == 0 else ["boto3", "framewire"]
        for kind in order:
            run, same = uploads(kind, path, env, s3)
            runs[kind].append(run)
            ok = ok and same
    med = {k: statistics.median(r["wall_s"] for r in v) for k, v in runs.items()}
    peak = {k: max(r["extra_bytes"] for r in v) for k, v in runs.items()}
    return {"bytes": path.stat().st_size, "framewire_s": med["framewire"],
            "boto3_s": med["boto3"], "framewire_extra": peak["framewire"],
            "boto3_extra": peak["boto3"], "same": ok}  # fmt: skip


def big_row(root: Path, env: dict[str, str], mib: int, s3: Any, repeat: int) -> dict:
    path = root / "big.mp4"
    with open(path, "wb") as f:
        block = np.random.default_rng(7).bytes(8 * MIB)
        for _ in range(mib // 8):
            f.write(block)
    return {"what": f"{mib} MiB file"} | compared(path, env, s3, repeat)


def main() -> int:
    parser = harness.parser(__doc__.splitlines()[0], frames=120, width=1344, height=768, repeat=3)
    parser.add_argument("--big-mib", dest="big_mib", type=harness.count, default=1024)
    args = parser.parse_args()
    with moto_server() as moto, tempfile.TemporaryDirectory(prefix="fw-objects-") as tmp:
        env = store_env(moto.endpoint)
        s3 = moto.client(KEY_ID, SECRET)
        s3.create_bucket(Bucket=BUCKET)
        rows = [
            output_row(Path(tmp), env, args, s3),
            big_row(Path(tmp), env, args.big_mib, s3, args.repeat),
        ]
    print(f"{'upload':<34} {'MiB':>8} {'framewire s':>12} {'boto3 s':>9} {'ratio':>6} "
          f"{'fw extra MiB':>13} {'boto3 extra MiB':>16}")  # fmt: skip
    for r in rows:
        print(f"{r['what']:<34} {r['bytes'] / MIB:>8.1f} {r['framewire_s']:>12.3f} "
              f"{r['boto3_s']:>9.3f} {r['framewire_s'] / r['boto3_s']:>6.2f} "
              f"{r['framewire_extra'] / MIB:>13.1f} {r['boto3_extra'] / MIB:>16.1f}")  # fmt: skip
    harness.write_json(args.json, rows)
    if not all(r["same"] for r in rows):
        print("objects differ from their files", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(*sys.argv[2:])
    else:
        harness.run(main)
