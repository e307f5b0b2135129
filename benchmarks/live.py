"""Live view benchmark: how soon a streamed chunk is playable and shown, on the watch
page (MSE over ``live.mp4``) and in hls.js (LL-HLS over ``live.m3u8``), beside the
encoder's own output latency; and what HLS viewers cost the encode.

    .venv/bin/python benchmarks/live.py [--frames 600] [--chunk 8] [--fps 24]
        [--sizes 672x384 1344x768] [--load 0.75] [--wall-runs 5] [--wall-viewers 8]
        [--wall-size 672x384] [--wall-frames 240] [--json OUT]

Per size, one worker; a producer hands it a float32 clip in chunks through
``open_video(..., live=True)``. A calibration run (no live view, chunks as fast as
the worker takes them) gives the encoder's own frame rate on this host; the
measured runs then produce at ``--load`` times that rate (the browser decodes on
the same cores), or in real time if that is slower (a viewer plays at ``--fps``).
For chunk k, handed to the worker at time h_k, and the frame it ends with:

  floor      x264's own latency: the same encode command writing raw H.264 to a
             pipe (``-flush_packets 1``), fed the same chunks at the same rate;
             when that frame's slice came out of ffmpeg (counted in decode order)
  playable   when the player's buffer first reached past the frame (the page's
             <video>.buffered, sampled each animation frame and at each append)
  shown      when the player presented it (requestVideoFrameCallback's mediaTime)

Delays are those times minus h_k, p50 and p95 over the chunks after the first (the
first also waits for the page and the player to start) whose frames the player had:
hls.js joins at a segment's start once the playlist lists a whole segment (a
keyframe-to-keyframe run, up to 250 frames), so it skips what came before;
"first shown" is when it showed its first frame, from the first chunk handed. Chromium is Debian's,
headless, driven by Playwright, launched once; each run has a page of a fresh browser
context (no cache or storage of the runs before). hls.js is tests/support/hlsjs.py's
pinned release, in low-latency mode, on a page of another origin.

Wall: the worker's encode_ms for the file, chunks as fast as taken, with no viewer
and with ``--wall-viewers`` LL-HLS followers (tests/support/hls_follow.py: blocking
reloads, every part fetched; no decoding), alternating, ``--wall-runs`` of each:
medians, their ratio, and the spread of the runs without viewers as the noise.
Every file's sha256 must equal its size's calibration run's.
"""

from __future__ import annotations

import argparse
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

# Installed on either page: what was playable when, and which frame was shown when.
RECORDER = """() => {
  const video = document.querySelector("video");
  const log = window.benchLog = {buffered: [], shown: []};
  const sample = () => {
    const b = video.buffered;
    if (!b.length) return;
    const end = b.end(b.length - 1), last = log.buffered.at(-1);
    if (!last || end > last[1]) log.buffered.push([b.start(0), end, Date.now()]);
  };
  const tick = () => { sample(); requestAnimationFrame(tick); };
  tick();
  video.addEventListener("progress", sample);
  const onFrame = (_, meta) => {
    log.shown.push([meta.mediaTime, Date.now()]);
    video.requestVideoFrameCallback(onFrame);
  };
  video.requestVideoFrameCallback(onFrame);
}"""


# hls.js as configured: low-latency mode with its defaults (it aims at PART-HOLD-BACK behind
# the edge, and plays at 1x once there), and with the catch-up low-latency players set (up
# to 1.5x until it is at that target again).
PLAYERS: dict[str, dict[str, float]] = {"hls": {}, "hls-1.5x": {"maxLiveSyncPlaybackRate": 1.5}}


def _first(records: list[tuple[float, float]], at_least: float) -> float | None:
    return next((t for v, t in records if v >= at_least), None)


def delays(handed: list[float], ends: list[int], log: dict[str, Any], fps: float,
           origin: float) -> dict:  # fmt: skip
    """Per chunk after the first whose last frame the player had (a player may join
    later than the first frame): ms from its handing to playable and to shown.
    ``origin``: frame 0's time on the player's timeline."""
    playable = [(end, t) for _, end, t in log["buffered"]]
    first_shown = log["shown"][0][0] if log["shown"] else float("inf")
    out: dict[str, Any] = {"playable": [], "shown": []}
    for h, n in zip(handed[1:], ends[1:], strict=True):
        frame_at = origin + (n - 1) / fps  # the chunk's last frame
        if frame_at < log["buffered"][0][0] - 0.5 / fps:
            continue  # before the player's first frame: it never had it
        p = _first(playable, frame_at + 0.5 / fps)
        shown_it = frame_at >= first_shown - 0.5 / fps
        s = _first(log["shown"], frame_at - 0.5 / fps) if shown_it else None
        if p is not None:
            out["playable"].append(p - h)
        if s is not None:
            out["shown"].append(s - h)
    out["first_shown_ms"] = log["shown"][0][1] - handed[0] if log["shown"] else None
    return out


def _paced(chunks: list[np.ndarray], rate: float | None, hand: Any) -> tuple[list, list]:
    """Hand ``chunks`` at ``rate`` frames/s (None: as fast as taken): when, and the frame
    count after each."""
    handed, ends, sent, start = [], [], 0, time.monotonic()
    for chunk in chunks:
        if rate is not None:
            time.sleep(max(0.0, start + sent / rate - time.monotonic()))
        handed.append(time.time() * 1e3)
        hand(chunk)
        sent += chunk.shape[1]
        ends.append(sent)
    return handed, ends


def encoder_floor(chunks: list[np.ndarray], fps: float, rate: float) -> dict[str, Any]:
    """x264's output latency for the same command, writing raw H.264 to a pipe."""
    import imageio_ffmpeg
    from framewire.core.media.argv import encode_argv, x264_auto_threads

    _, _, height, width = chunks[0].shape
    argv = encode_argv(imageio_ffmpeg.get_ffmpeg_exe(), width=width, height=height, fps=fps,
                       output="pipe:1", threads=x264_auto_threads(height))  # fmt: skip
    argv = [*argv[:-1], "-f", "h264", "-flush_packets", "1", "pipe:1"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    out: list[float] = []  # when each frame's slice came out, in decode order

    def read() -> None:
        data = bytearray()
        assert proc.stdout is not None
        while block := os.read(proc.stdout.fileno(), 1 << 16):
            now = time.time() * 1e3
            scan = max(0, len(data) - 3)
            data += block
            at = data.find(b"\x00\x00\x01", scan)
            while at >= 0 and at + 3 < len(data):
                if data[at + 3] & 0x1F in (1, 5):  # a coded slice: one a frame here
                    out.append(now)
                at = data.find(b"\x00\x00\x01", at + 3)

    reader = threading.Thread(target=read)
    reader.start()

    def feed(chunk: np.ndarray) -> None:
        frames = (np.clip(chunk, 0, 1) * 255 + 0.5).astype(np.uint8).transpose(1, 2, 3, 0)
        assert proc.stdin is not None
        proc.stdin.write(frames.tobytes())
        proc.stdin.flush()

    handed, ends = _paced(chunks, rate, feed)
    assert proc.stdin is not None
    proc.stdin.close()
    reader.join(120)
    proc.wait(60)
    ms = [out[n - 1] - h for h, n in zip(handed[1:], ends[1:], strict=True) if n <= len(out)]
    return {"player": "floor", "delays_ms": {"playable": ms, "shown": [], "first_shown_ms": None}}


def viewed_run(worker: Any, browser: Any, chunks: list[np.ndarray], fps: float, rate: float,
               player: str, name: str, origin: float | None) -> dict[str, Any]:  # fmt: skip
    """One run with ``browser`` watching, on a page of a context of its own (no cache or
    storage of the runs before it): ``mse`` (the watch page) or ``hls`` (hls.js).

    Both keep the file's own timestamps (hls.js passes fMP4 through without moving it),
    so frame 0 is where the MSE page's buffer starts (x264's B-frame delay after 0):
    ``origin`` None takes it from this run, which must then start at frame 0. hls.js
    joins at a segment or part of the live edge, so its run is given the MSE run's."""
    from framewire.client import Client

    from tests.support.browser import fresh_page
    from tests.support.hlsjs import open_hls_player

    with Client(worker.uds_url, timeout=600) as client, fresh_page(browser) as page:
        writer = client.open_video(name, fps=fps, live=True)
        first_at = time.time() * 1e3
        writer.write(chunks[0])
        assert writer.watch_url is not None and writer.hls_url is not None
        if player == "mse":
            page.goto(writer.watch_url + "&player=mse")
        else:
            open_hls_player(page, writer.hls_url, **PLAYERS[player])
        page.evaluate(RECORDER)
        handed, ends = _paced(chunks[1:], rate, writer.write)
        result = writer.close()
        total = ends[-1] + chunks[0].shape[1]
        deadline = time.monotonic() + 120
        while True:  # until the last frame was shown (or playable, at the latest)
            log = page.evaluate("window.benchLog")
            start = origin if origin is not None else (log["buffered"] or [[0.0]])[0][0]
            shown = log["shown"] and log["shown"][-1][0] >= start + (total - 1.5) / fps
            if shown or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert result.ok and result.sha256 is not None
    ends = [chunks[0].shape[1]] + [n + chunks[0].shape[1] for n in ends]
    return {"player": player, "sha256": result.sha256,
            "origin_s": start,
            "delays_ms": delays([first_at, *handed], ends, log, fps, start)}  # fmt: skip


def wall_run(worker: Any, chunks: list[np.ndarray], fps: float, viewers: int,
             name: str) -> dict[str, Any]:  # fmt: skip
    """The file's encode wall, chunks as fast as taken, with ``viewers`` LL-HLS followers."""
    from framewire.client import Client

    from tests.support.hls_follow import Follower

    with Client(worker.uds_url, timeout=600) as client:
        writer = client.open_video(name, fps=fps, live=viewers > 0)
        writer.write(chunks[0])
        followers = [Follower(writer.hls_url or "") for _ in range(viewers)]
        for f in followers:
            f.start()
        _paced(chunks[1:], None, writer.write)
        result = writer.close()
        for f in followers:
            f.result(120)
    assert result.ok and result.sha256 is not None
    return {"viewers": viewers, "wall_ms": result.timings.encode_ms, "sha256": result.sha256,
            "followed_bytes": [len(f.media()) for f in followers]}  # fmt: skip


def _chunks(frames: int, chunk: int, width: int, height: int) -> list[np.ndarray]:
    return [clip_chunk(t0, min(t0 + chunk, frames), height, width)
            for t0 in range(0, frames, chunk)]  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=harness.count, default=600)
    p.add_argument("--wall-frames", type=harness.count, default=240)
    p.add_argument("--chunk", type=harness.count, default=8)
    p.add_argument("--fps", type=float, default=24)
    p.add_argument("--sizes", type=harness.size, nargs="+", default=[(672, 384), (1344, 768)])
    p.add_argument("--load", type=float, default=0.75, help="of the calibrated encoder rate")
    p.add_argument("--wall-runs", type=harness.count, default=5)
    p.add_argument("--wall-viewers", type=harness.count, default=8)
    p.add_argument("--wall-size", type=harness.size, default=(672, 384))
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    from tests.support.browser import browser_missing, chromium
    from tests.support.hlsjs import hlsjs_missing
    from tests.support.worker import start_worker

    missing = browser_missing() or hlsjs_missing()
    if missing is not None:
        print(f"no browser or no hls.js: {missing}", file=sys.stderr)
        return 1
    rows: list[dict[str, Any]] = []
    walls: list[dict[str, Any]] = []
    same = True
    with tempfile.TemporaryDirectory() as tmp:
        worker = start_worker(Path(tmp), "--log-level", "warning")
        try:
            # One browser for the viewed runs (a launch costs a second or two of CPU, here
            # before any run), closed before the walls are timed.
            with chromium() as browser:
                for width, height in args.sizes:
                    chunks = _chunks(args.frames, args.chunk, width, height)
                    calib = wall_run(worker, chunks, args.fps, 0, f"calib-{width}.mp4")
                    # Never faster than real time: a viewer plays at the clip's own rate.
                    rate = min(args.fps, args.load * args.frames / (calib["wall_ms"] / 1e3))
                    size = {"size": f"{width}x{height}", "rate_fps": rate}
                    rows.append(size | encoder_floor(chunks, args.fps, rate))
                    origin = None  # the MSE run's frame 0, then hls.js's (same encode)
                    for player in ("mse", *PLAYERS):
                        run = viewed_run(worker, browser, chunks, args.fps, rate, player,
                                         f"{player}-{width}.mp4", origin)  # fmt: skip
                        origin = run["origin_s"]
                        same &= run["sha256"] == calib["sha256"]
                        rows.append(size | run)
            width, height = args.wall_size
            chunks = _chunks(args.wall_frames, args.chunk, width, height)
            for i in range(args.wall_runs):
                for viewers in (0, args.wall_viewers):
                    walls.append(wall_run(worker, chunks, args.fps, viewers, f"w{i}-{viewers}.mp4"))
            same &= len({w["sha256"] for w in walls}) == 1
        except BaseException:
            print(worker.log.read_text()[-3000:], file=sys.stderr)
            raise
        finally:
            worker.stop()
    _report(args, rows, walls, same)
    harness.write_json(args.json, {"rows": rows, "walls": walls, "sha256_equal": same})
    return 0 if same else 1


def _report(args: argparse.Namespace, rows: list[dict], walls: list[dict], same: bool) -> None:
    print(f"{args.frames} frames in {args.chunk}-frame chunks at {args.fps:g} fps, produced at "
          f"{args.load:g} x the calibrated encoder rate")  # fmt: skip
    print(f"{'size':>9} {'player':>6} {'rate fps':>8} {'playable p50':>12} {'p95':>6} "
          f"{'shown p50':>9} {'p95':>6} {'chunks':>6} {'first shown':>11}"
          "  (ms from a chunk handed over)")  # fmt: skip
    floors: dict[str, float] = {}
    for row in rows:
        d = row["delays_ms"]
        cells = []
        for key in ("playable", "shown"):
            v = d[key]
            median = f"{statistics.median(v):.0f}" if v else "-"
            cells += [median, f"{harness.pct(v, 0.95):.0f}" if v else "-"]
        first = "-" if d["first_shown_ms"] is None else f"{d['first_shown_ms']:.0f}"
        counted = len(d["shown"] or d["playable"])
        name = {"floor": "x264", "mse": "MSE"}.get(row["player"], row["player"].upper())
        print(f"{row['size']:>9} {name:>6} {row['rate_fps']:>8.1f} {cells[0]:>12} {cells[1]:>6} "
              f"{cells[2]:>9} {cells[3]:>6} {counted:>6} {first:>11}")  # fmt: skip
        if row["player"] == "floor" and d["playable"]:
            floors[row["size"]] = statistics.median(d["playable"])
        if row["player"] in PLAYERS and d["shown"] and row["size"] in floors:
            over = statistics.median(d["shown"]) - floors[row["size"]]
            goal = "met" if over <= 500 else "MISSED"
            print(f"{'':>9} {name} shown p50 - x264 p50 = {over:.0f} ms (goal <= 500 ms: {goal})")
    if walls:
        none = [w["wall_ms"] for w in walls if w["viewers"] == 0]
        some = [w["wall_ms"] for w in walls if w["viewers"] > 0]
        m0, m1 = statistics.median(none), statistics.median(some)
        noise = (max(none) - min(none)) / m0 * 100
        print(
            f"file wall at {args.wall_size[0]}x{args.wall_size[1]}, {len(none)} runs each: "
            f"no viewer {m0:.0f} ms, {args.wall_viewers} HLS viewers {m1:.0f} ms, ratio "
            f"{m1 / m0:.3f} (goal <= 1.03); spread of the runs without viewers {noise:.1f} %"
        )
    print(f"sha256 equal in every run (and to each size's calibration run): {same}")


if __name__ == "__main__":
    harness.run(main)
