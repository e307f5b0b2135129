"""Load: 64 encodes and 32 reference decodes at once against one worker, over its sockets.

The worker's queue is made small (16) so the burst overflows it. Each request
must then either succeed, byte-exact, or be refused with 429 (encodes:
``queue_full`` with Retry-After; decodes: ``overloaded``). The worker's memory
must stay bounded, and afterwards nothing may be left behind.
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from framewire.client import Client, Overloaded

from tests.support.media import make_clip, reference_mp4, sha256
from tests.support.refclips import make_video, oracle
from tests.support.requests import Baseline, encode_body, settle
from tests.support.worker import metric

ENCODES, DECODES, QUEUE = 64, 32, 16
CLIPS = 4  # distinct clips, round robin over the encodes
# Peak RSS growth allowed over the burst. What bounds it: two encodes run at a time
# with 1 MiB chunks, the rest wait as small request objects. Measured: 9 MiB on 2 cores.
RSS_BOUND_MIB = 256
CACHE_BYTES = 256 << 10  # less than the decodes make: the cache must evict


WORKER_ARGS = (
    "--max-queue",
    str(QUEUE),
    "--chunk-bytes",
    str(1 << 20),
    "--cpu-slots",
    "2",
    "--decode-cache-bytes",
    str(CACHE_BYTES),
)  # fmt: skip  (the module's worker: tests/conftest.py)


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def test_encodes_and_decodes_at_once(worker, segments, tmp_path):
    clips = [make_clip(frames=12, height=96, width=96, seed=s) for s in range(CLIPS)]
    sources = [segments.source(c) for c in clips]
    expected = [reference_mp4(c, tmp_path / f"ref{i}.mp4") for i, c in enumerate(clips)]
    video = make_video(worker.inputs / "ref.mp4", "testsrc2=size=97x61:rate=25", 1.0)
    # Distinct parameters: every decode is its own ffmpeg run, none coalesced or cached.
    decode_params = [{"fps": 4 + i / 4, "width": 40, "height": 24} for i in range(DECODES)]
    decode_expected = [oracle(video, **p) for p in decode_params]

    with Client(worker.uds_url) as c:  # warm up: imports, first ffmpeg, first staging slot
        c.save_video(clips[0].numpy(), "warm.mp4", fps=24)
    (worker.outputs / "warm.mp4").unlink()
    baseline = Baseline.of(worker)
    hwm_before = status_kib(worker.pid, "VmHWM")
    start = threading.Barrier(ENCODES + DECODES)

    def encode(i: int) -> tuple[str, Any]:
        start.wait()
        with worker.http() as http:
            r = http.post(
                "/v1/videos:encode", json=encode_body(sources[i % CLIPS], f"load/{i}.mp4")
            )
        if r.status_code == 429:
            assert r.json()["code"] == "queue_full" and float(r.headers["retry-after"]) > 0
            return "encode 429", None
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["sha256"] == expected[i % CLIPS]
        assert sha256(worker.outputs / "load" / f"{i}.mp4") == expected[i % CLIPS]
        return "encode 200", None

    def decode(i: int) -> tuple[str, Any]:
        start.wait()
        with Client(fd_socket=worker.uds.parent / "fd.sock") as client:
            try:
                with client.decode_reference(str(video), **decode_params[i]) as ref:
                    assert ref.source == "worker"
                    assert np.asarray(ref.frames).tobytes() == decode_expected[i]
            except Overloaded as exc:
                assert exc.code == "overloaded"
                return "decode 429", None
        return "decode 200", None

    with ThreadPoolExecutor(ENCODES + DECODES) as pool:
        futures = [pool.submit(encode, i) for i in range(ENCODES)]
        futures += [pool.submit(decode, i) for i in range(DECODES)]
        outcomes = Counter(f.result(timeout=300)[0] for f in futures)

    growth_mib = (status_kib(worker.pid, "VmHWM") - hwm_before) / 1024
    print(f"\nload: {dict(sorted(outcomes.items()))}; peak RSS growth {growth_mib:.0f} MiB")
    assert outcomes["encode 200"] + outcomes["encode 429"] == ENCODES
    assert outcomes["decode 200"] + outcomes["decode 429"] == DECODES
    # The queue bounds what waits, it does not refuse what fits: at least the running
    # slots plus a full queue of each kind got through.
    assert outcomes["encode 200"] >= 2 + QUEUE and outcomes["decode 200"] >= 2 + QUEUE
    # ...and past it, refuses: the burst outran two encode slots.
    assert outcomes["encode 429"] > 0
    assert growth_mib < RSS_BOUND_MIB
    with worker.http() as http:
        assert metric(http, "framewire_decode_cache_bytes") <= CACHE_BYTES
    for path in (worker.outputs / "load").iterdir():
        path.unlink()
    settle(worker, baseline, keep=frozenset(segments.keys))
