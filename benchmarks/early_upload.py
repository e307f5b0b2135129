"""Objects ready when the encode ends: a stream session to s3:// with its parts uploaded
while it is encoded, against the upload after the encode.

    .venv/bin/python benchmarks/early_upload.py [--rates 20 100] [--frames 120 480]
                     [--width 1344 --height 768] [--pace 10] [--repeat 2] [--json OUT]

moto's S3 server on loopback behind a proxy that carries request bodies at --rates MB/s
(the link, shared by every request in flight). Two workers, the same settings (8 MiB
parts) but one with ``--no-upload-while-encoding`` ("after", the path before) and one
without ("while"). A producer streams the clip to each in 8-frame chunks at --pace frames
a second (a VAE's pace; 0: as fast as the worker takes them), then asks for the finish.
Cases: --frames frames of noise (x264 keeps most of it: about 0.4 MB a frame at
1344x768, so 120 frames make a 48 MB object and 480 the large one, 194 MB; the shared
smooth clip would make objects under one part, which go in one PUT either way). Each case
and rate runs --repeat times, the two paths taking turns.

Per run: ``finish s``, from the finish asked for to the object complete (the finish
request's answer: the encoder's last frames, then the upload's end); ``at store``, the
share of the object's bytes the store had taken (UploadPart answered) when the finish
was asked for; ``after file s``, the worker's ``upload_ms``, from the file complete to
the object complete (and of it, the store's own CompleteMultipartUpload), against two
parts' time at the rate. Goals: at least half of a
large object at the store before the finish; the object complete within two parts'
upload time after the file is. Every object's sha256 is checked against the result's.
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
import numpy as np  # noqa: E402
from framewire.client import Client  # noqa: E402

from tests.support.objstore import (  # noqa: E402
    KEY_ID,
    SECRET,
    Proxy,
    moto_server,
    part_number,
    proxy_to,
    store_env,
)
from tests.support.worker import Worker, start_worker  # noqa: E402

BUCKET = "bench"
PART = 8 << 20
CHUNK = 8
MB = 1e6


def chunks(frames: int, height: int, width: int) -> Any:
    """The clip's (T, H, W, 3) uint8 chunks of noise, made as they are sent (480 frames at
    1344x768 would be 1.5 GB at once)."""
    rng = np.random.default_rng(5)
    for t0 in range(0, frames, CHUNK):
        yield rng.integers(0, 256, (min(CHUNK, frames - t0), height, width, 3), np.uint8)


def one_run(
    worker: Worker, proxy: Proxy, s3: Any, key: str, frames: int, args: Any
) -> dict[str, float]:
    with Client(worker.uds_url, timeout=900) as client:
        writer = client.open_video(f"s3://{BUCKET}/{key}", fps=24)
        start = time.monotonic()
        for i, chunk in enumerate(chunks(frames, args.height, args.width)):
            if args.pace:  # the producer's own pace: a VAE decoding --pace frames a second
                time.sleep(max(0.0, start + i * CHUNK / args.pace - time.monotonic()))
            writer.write(chunk)
        asked = time.monotonic()
        result = writer.close()
        done = time.monotonic()
    assert result is not None and result.ok, result
    body = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    assert hashlib.sha256(body).hexdigest() == result.sha256, key
    s3.delete_object(Bucket=BUCKET, Key=key)
    early = sum(
        size
        for method, target, size, ended in list(proxy.answered)
        if method == "PUT" and part_number(target) and key in target and ended < asked
    )
    began = [at for (m, t), at in zip(proxy.seen, proxy.at, strict=False)
             if m == "POST" and key in t and "uploadId=" in t]  # fmt: skip
    ended = [e for m, t, _, e in proxy.answered if m == "POST" and key in t and "uploadId=" in t]
    complete = ended[-1] - began[-1] if began and ended else 0.0
    return {"finish_s": done - asked, "at_store": early / len(body), "bytes": len(body),
            "after_file_s": result.timings.upload_ms / 1e3, "complete_s": complete}  # fmt: skip


def main() -> int:
    p = harness.parser(__doc__ or "", frames=[120, 480], width=1344, height=768, repeat=2)
    p.add_argument("--rates", type=float, nargs="+", default=[20.0, 100.0], help="MB/s")
    p.add_argument("--pace", type=float, default=10.0,
                   help="frames a second the producer makes (0: as fast as taken)")  # fmt: skip
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    with moto_server() as moto, proxy_to(moto.endpoint) as proxy, \
            tempfile.TemporaryDirectory(prefix="fw-early-") as tmp:  # fmt: skip
        s3 = moto.client(KEY_ID, SECRET)
        s3.create_bucket(Bucket=BUCKET)
        env = store_env(proxy.endpoint)
        common = ("--output-urls", f"s3://{BUCKET}/", "--upload-part-bytes", str(PART),
                  "--store-timeout-s", "120")  # fmt: skip
        workers = {
            "after": start_worker(
                Path(tmp) / "after", *common, "--no-upload-while-encoding", env=env
            ),
            "while": start_worker(Path(tmp) / "while", *common, env=env),
        }
        try:
            for rate in args.rates:
                proxy.rate = rate * MB
                for frames in args.frames:
                    runs: dict[str, list[dict[str, float]]] = {"after": [], "while": []}
                    for r in range(args.repeat):
                        order = ("after", "while") if r % 2 == 0 else ("while", "after")
                        for mode in order:
                            proxy.reset()
                            key = f"{frames}-{mode}-{r}.mp4"
                            runs[mode].append(one_run(workers[mode], proxy, s3, key, frames, args))
                    rows.append({"rate": rate, "case": f"{frames} frames", "runs": runs})
                    report(rows[-1])
        finally:
            for worker in workers.values():
                worker.stop()
    harness.write_json(args.json, rows)
    return 0


def report(row: dict[str, Any]) -> None:
    def med(mode: str, field: str) -> float:
        return statistics.median(r[field] for r in row["runs"][mode])

    def spread(mode: str, field: str) -> str:
        values = [r[field] for r in row["runs"][mode]]
        return f"{min(values):.2f}..{max(values):.2f}"

    two_parts = 2 * PART / (row["rate"] * MB)
    size = med("while", "bytes") / MB
    print(f"{row['rate']:.0f} MB/s, {row['case']}, {size:.1f} MB, two parts {two_parts:.2f} s")
    print(f"  {'path':<6} {'finish s':>9} {'spread':>12} {'at store':>9} {'after file s':>13} "
          f"{'of it Complete s':>17}")  # fmt: skip
    for mode in ("after", "while"):
        print(f"  {mode:<6} {med(mode, 'finish_s'):9.2f} {spread(mode, 'finish_s'):>12} "
              f"{med(mode, 'at_store'):9.0%} {med(mode, 'after_file_s'):13.2f} "
              f"{med(mode, 'complete_s'):17.2f}")  # fmt: skip
    ratio = med("while", "finish_s") / med("after", "finish_s")
    print(f"  while / after: {ratio:.2f}x", flush=True)


if __name__ == "__main__":
    harness.run(main)
