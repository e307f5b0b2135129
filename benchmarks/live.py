"""Live view benchmark: how soon a streamed chunk plays in a browser, and what watching
costs the encode.

    .venv/bin/python benchmarks/live.py [--frames 120] [--chunk 8] [--width 1344 --height 768]
                                        [--viewers 0 1 8] [--http-only] [--json OUT]

One worker; a producer hands it a float32 clip in chunks through ``open_video(...,
live=True)``. A calibration run (no live view, chunks as fast as the worker takes
them) gives the encoder's own frame rate on this host; each measured run then
produces at that rate, with 0, 1 or 8 viewers: the first viewer is the watch page
in headless Chromium (tests/support/browser.py), the others read ``live.mp4`` over
HTTP (``--http-only``: all of them, so the wall shows the live view's own cost, not
a browser decoding video on the same cores). Per run:

  file wall  the worker's encode_ms for the file (first chunk -> file complete)
  sha256     of the file: every run's must equal the calibration's
  delay      chunk k handed to the worker -> the page has appended the fragment
             holding its last frame (its SourceBuffer's updateend: playable), from
             the page's own record (``framewireLive.playable``, frame counts and
             Date.now()); p50 and p95 over the chunks after the first (the first
             also waits for the page to load)

The delay includes x264's lookahead: the encoder holds some 35 frames (fast preset)
before its first packet, whatever the live view does.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
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
import httpx  # noqa: E402
import numpy as np  # noqa: E402
from encode import clip_chunk  # noqa: E402  (the shared clip generator)


def read_live(url: str, done: list[int]) -> None:
    """A plain HTTP viewer: reads the byte stream to its end."""
    total = 0
    with httpx.Client(timeout=600) as http, http.stream("GET", url) as r:
        for block in r.iter_bytes():
            total += len(block)
    done.append(total)


def until(page: Any, expression: str, timeout: float = 120) -> None:
    """Poll ``expression`` in the page (its CSP forbids the eval of wait_for_function)."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{expression}: {page.evaluate('window.framewireLive')}")
        time.sleep(0.02)


def one_run(worker: Any, chunks: list[np.ndarray], fps: float, rate: float | None,
            viewers: int, name: str, browser: bool = True) -> dict[str, Any]:  # fmt: skip
    """Stream ``chunks`` (at ``rate`` frames/s; None: as fast as taken) with ``viewers``
    (the first in Chromium when ``browser``)."""
    from framewire.client import Client

    handed: list[float] = []  # ms since the epoch, per chunk
    frames_after: list[int] = []
    with Client(worker.uds_url, timeout=600) as client, ViewerPage(viewers and browser) as page:
        writer = client.open_video(name, fps=fps, live=viewers > 0)
        handed.append(time.time() * 1e3)
        writer.write(chunks[0])
        frames_after.append(chunks[0].shape[1])
        readers: list[threading.Thread] = []
        read: list[int] = []
        if viewers:
            assert writer.watch_url is not None
            if page is not None:
                page.goto(writer.watch_url)
                until(page, "window.framewireLive !== undefined")
            live_url = writer.watch_url.replace("/watch?", "/live.mp4?")
            for _ in range(viewers - (page is not None)):
                readers.append(threading.Thread(target=read_live, args=(live_url, read)))
                readers[-1].start()
        start = time.monotonic()
        sent = chunks[0].shape[1]
        for chunk in chunks[1:]:
            if rate is not None:
                time.sleep(max(0.0, start + sent / rate - time.monotonic()))
            handed.append(time.time() * 1e3)
            writer.write(chunk)
            sent += chunk.shape[1]
            frames_after.append(sent)
        result = writer.close()
        delays: list[float] = []
        if page is not None:
            until(page, f"(window.framewireLive.playable.at(-1) || [0])[0] >= {sent}")
            playable = page.evaluate("window.framewireLive.playable")
            for k in range(1, len(chunks)):
                at = next(t for n, t in playable if n >= frames_after[k])
                delays.append(at - handed[k])
        for r in readers:
            r.join(60)
    assert result.ok and result.sha256 is not None
    digest = hashlib.sha256((worker.outputs / name).read_bytes()).hexdigest()
    assert digest == result.sha256
    return {"viewers": viewers, "wall_ms": result.timings.encode_ms, "sha256": digest,
            "delays_ms": delays, "http_viewer_bytes": read}  # fmt: skip


class ViewerPage:
    """The Chromium page when there are viewers, else nothing."""

    def __init__(self, viewers: int | bool):
        self.viewers = viewers
        self._cm: Any = None

    def __enter__(self) -> Any:
        if not self.viewers:
            return None
        from tests.support.browser import chromium_page

        self._cm = chromium_page()
        return self._cm.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._cm is not None:
            self._cm.__exit__(*exc)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, default=120)
    p.add_argument("--chunk", type=int, default=8)
    p.add_argument("--width", type=int, default=1344)
    p.add_argument("--height", type=int, default=768)
    p.add_argument("--fps", type=float, default=24)
    p.add_argument("--viewers", type=int, nargs="+", default=[0, 1, 8])
    p.add_argument(
        "--http-only",
        action="store_true",
        help="every viewer a plain HTTP reader: the live view's own cost, no browser",
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    from tests.support.browser import browser_missing
    from tests.support.worker import start_worker

    missing = browser_missing()
    if missing is not None:
        print(f"no browser: {missing}", file=sys.stderr)
        return 1
    chunks = [clip_chunk(t0, min(t0 + args.chunk, args.frames), args.height, args.width)
              for t0 in range(0, args.frames, args.chunk)]  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        worker = start_worker(Path(tmp), "--log-level", "warning")
        try:
            calib = one_run(worker, chunks, args.fps, None, 0, "calibrate.mp4")
            rate = args.frames / (calib["wall_ms"] / 1e3)
            for v in args.viewers:
                rows.append(one_run(worker, chunks, args.fps, rate, v, f"live-{v}.mp4",
                                    not args.http_only))  # fmt: skip
        except BaseException:
            print(worker.log.read_text()[-3000:], file=sys.stderr)
            raise
        finally:
            worker.stop()
    same = all(row["sha256"] == calib["sha256"] for row in rows)
    print(f"{args.frames} frames of {args.width}x{args.height} in {args.chunk}-frame chunks; "
          f"encoder rate (calibration, no live view): {rate:.1f} fps")  # fmt: skip
    print(f"{'viewers':>7} {'file wall ms':>12} {'delay p50 ms':>12} {'delay p95 ms':>12}  sha256")
    for row in rows:
        d = row["delays_ms"]
        p50 = f"{statistics.median(d):.0f}" if d else "-"
        p95 = f"{pct(d, 0.95):.0f}" if d else "-"
        print(f"{row['viewers']:>7} {row['wall_ms']:>12.0f} {p50:>12} {p95:>12}  "
              f"{row['sha256'][:16]}")  # fmt: skip
    print(f"sha256 equal in every run (and to the calibration run's): {same}")
    harness.write_json(args.json, {"rate_fps": rate, "rows": rows})
    return 0 if same else 1


if __name__ == "__main__":
    harness.run(main)
