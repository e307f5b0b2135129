"""``framewire demo``: what an inference process does with a worker, end to end, timed.

It saves two synthetic diffusion-like clips through the worker in one request
(the frames are handed over as memfds on the fd socket, never copied into a
request), streams the
first again chunk by chunk as a VAE would decode it (the file must be the same
bytes), writes a
reference video where the worker reads references, and has several processes
ask for the same reference decode at once: the worker decodes it once and every
process maps the same pages. If no worker answers at the URL, one is started for
the demo with temporary roots and stopped at the end.

Only the client side is imported here (no torch), so the rank processes start fast.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from framewire.client import Client, FramewireError, OutputResult, Unavailable
from framewire.core.media.process import find_ffmpeg

WORKER_START_S = 60.0
RANK_WAIT_S = 120.0


@dataclass(frozen=True)
class DemoOptions:
    """What ``framewire demo`` was asked for: its flags, whose defaults are the parser's."""

    url: str
    token: str | None
    fd_socket: str | None  # None: the worker's, from /v1/info
    inputs: Path | None  # None: the worker's first input root
    frames: int
    width: int
    height: int
    ranks: int
    chunk: int  # frames per streamed chunk
    wait: float | None  # seconds to wait for the worker at url; None: start one
    fps: float = 24.0


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    pid: int
    ms: float
    source: str = ""
    cached: bool = False
    frames: int = 0
    sha256: str = ""
    error: str = ""


class Table:
    """Rows of (step, what happened, milliseconds), printed as aligned columns."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []

    def add(self, step: str, result: str, ms: float | None = None) -> None:
        self.rows.append((step, result, "" if ms is None else f"{ms:,.0f}"))

    def render(self) -> str:
        rows = [("step", "result", "ms"), *self.rows]
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        w2 = max(len(r[2]) for r in rows)
        lines = [f"{a:<{w0}}  {b:<{w1}}  {c:>{w2}}" for a, b, c in rows]
        lines.insert(1, f"{'-' * w0}  {'-' * w1}  {'-' * w2}")
        return "\n".join(lines)


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1e3


def synthetic_clip(frames: int, height: int, width: int, seed: int) -> np.ndarray:
    """A (3, T, H, W) float32 clip in [0, 1] like a VAE's output: smooth motion plus noise."""
    rng = np.random.default_rng(seed)
    t = np.linspace(0, 1, frames, dtype=np.float32)[:, None, None]
    y = np.linspace(0, 1, height, dtype=np.float32)[None, :, None]
    x = np.linspace(0, 1, width, dtype=np.float32)[None, None, :]
    waves = [
        0.5 + 0.4 * np.sin(7 * x + 5 * y - 6 * t + phase + seed) * np.cos(3 * y + 2 * t)
        for phase in (0.0, 2.1, 4.2)
    ]
    clip = np.stack(waves).astype(np.float32)
    clip += 0.04 * rng.standard_normal(clip.shape, dtype=np.float32)
    return np.clip(clip, 0, 1, out=clip)


def stream_clip(
    client: Client, clip: np.ndarray, path: str, opts: DemoOptions
) -> tuple[OutputResult, str | None]:
    """Write ``clip`` as a VAE hands it over, ``opts.chunk`` frames at a time, with a live
    view (its watch page's URL is printed as soon as the session is open)."""
    with client.open_video(path, fps=opts.fps, live=True) as writer:
        for t0 in range(0, clip.shape[1], opts.chunk):
            writer.write(clip[:, t0 : t0 + opts.chunk])
            if t0 == 0:
                print(f"watch it while it is encoded: {writer.watch_url}", flush=True)
    assert writer.result is not None
    return writer.result, writer.watch_url


def _worker_info(url: str, token: str | None) -> dict[str, Any] | None:
    """The worker's /v1/info, or None when nothing answers at ``url``."""
    try:
        with Client(url, token=token, timeout=5) as client:
            return client.info()
    except Unavailable:
        return None


def _await_info(
    url: str, token: str | None, seconds: float, every: float, gone: Callable[[], bool]
) -> dict[str, Any] | None:
    """The /v1/info of the worker at ``url`` once it answers; None when it did not within
    ``seconds``, or ``gone()`` says it never will."""
    deadline = time.monotonic() + seconds
    while (info := _worker_info(url, token)) is None:
        if gone() or time.monotonic() > deadline:
            return None
        time.sleep(every)
    return info


def wait_for_worker(url: str, token: str | None, seconds: float) -> dict[str, Any]:
    """The /v1/info of the worker at ``url`` once it answers, within ``seconds``."""
    print(f"waiting up to {seconds:g} s for a worker at {url}", file=sys.stderr, flush=True)
    info = _await_info(url, token, seconds, every=0.5, gone=lambda: False)
    if info is None:
        raise FramewireError(
            f"no framewire worker answered at {url} within {seconds:g} s "
            "(is it running, and is its socket volume mounted here?)",
            code="demo_failed",
        )
    return info


def _decodes_run(url: str, token: str | None) -> float | None:
    """The worker's count of ffmpeg reference decodes (from /metrics), if it tells."""
    transport = None
    if url.startswith("unix://"):
        transport, url = httpx.HTTPTransport(uds=url.removeprefix("unix://")), "http://framewire"
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(transport=transport, headers=headers, timeout=10) as http:
            text = http.get(f"{url.rstrip('/')}/metrics").text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("framewire_decodes_total "):
            return float(line.split()[1])
    return None


@contextlib.contextmanager
def own_worker(token: str | None) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """A worker for this demo alone: temporary roots and sockets, stopped and removed after.
    Yields its URL, pid and /v1/info."""
    with tempfile.TemporaryDirectory(prefix="framewire-demo-") as tmp:
        root = Path(tmp)
        for name in ("outputs", "inputs"):
            (root / name).mkdir()
        uds, log = root / "api.sock", root / "worker.log"
        cmd = [
            sys.executable, "-P", "-m", "framewire.service", "serve",
            "--port", "0", "--uds", str(uds), "--fd-socket", str(root / "fd.sock"),
            "--output-roots", str(root / "outputs"), "--input-roots", str(root / "inputs"),
            "--log-level", "warning",
        ]  # fmt: skip
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            url = f"unix://{uds}"
            info = _await_info(
                url, token, WORKER_START_S, every=0.1, gone=lambda: proc.poll() is not None
            )
            if info is None:
                raise Unavailable(f"the demo's worker did not start:\n{log.read_text()}")
            yield url, proc.pid, info
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def make_reference(path: Path, *, width: int, height: int, fps: float, frames: int) -> Path:
    """A test-pattern video at ``path``, written beside and renamed (the worker never
    sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    cmd = [
        find_ffmpeg(), "-v", "error", "-y",
        "-f", "lavfi", "-i", f"testsrc2=size={width}x{height}:rate={fps:g}",
        "-frames:v", str(frames), "-c:v", "libx264", "-preset", "ultrafast",
        "-pix_fmt", "yuv420p", "-f", "mp4", str(partial),
    ]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise FramewireError(
                f"ffmpeg could not write {partial}", code="demo_failed", detail=done.stderr
            )
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def _rank(
    rank: int,
    barrier: Any,
    results: Any,
    path: str,
    fd_socket: str,
    fps: float,
    width: int,
    height: int,
) -> None:
    """One rank: wait for the others, then ask for the reference like an inference process."""
    started = time.perf_counter()
    try:
        barrier.wait(timeout=RANK_WAIT_S)
        started = time.perf_counter()
        with (
            Client(fd_socket=fd_socket) as client,
            client.decode_reference(path, fps=fps, width=width, height=height) as ref,
        ):
            ms = _ms(started)
            digest = hashlib.sha256(ref.frames.data).hexdigest()
            outcome = RankOutcome(
                rank, os.getpid(), ms, ref.source, ref.cached, ref.shape[0], digest
            )
    except Exception as exc:
        outcome = RankOutcome(rank, os.getpid(), _ms(started), error=str(exc))
    results.put(outcome)


def decode_in_processes(
    path: Path, fd_socket: str, ranks: int, *, fps: float, width: int, height: int
) -> list[RankOutcome]:
    """``ranks`` processes ask for the same decode at the same moment."""
    # fork: the children need nothing but what this process already imported.
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(ranks), ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank,
            args=(r, barrier, results, str(path), fd_socket, fps, width, height),
            name=f"framewire-demo-rank-{r}",
        )
        for r in range(ranks)
    ]
    for proc in procs:
        proc.start()
    try:
        outcomes = [results.get(timeout=RANK_WAIT_S) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        results.close()
        results.join_thread()
    return sorted(outcomes, key=lambda o: o.rank)


def run_demo(opts: DemoOptions) -> int:
    table = Table()
    with contextlib.ExitStack() as stack:
        started = time.perf_counter()
        url, info = opts.url, _worker_info(opts.url, opts.token)
        if info is None and opts.wait is not None:
            info = wait_for_worker(url, opts.token, opts.wait)
            table.add("worker", f"answered at {url} after waiting", _ms(started))
        started_one = info is None
        if info is None:
            url, pid, info = stack.enter_context(own_worker(opts.token))
            what = f"none at {opts.url}: started one (pid {pid}) on temporary roots"
            table.add("worker", what, _ms(started))
        else:
            table.add("worker", f"framewire {info['version']} at {url}")
        fd_socket = opts.fd_socket or info["sockets"]["fd_socket"]
        inputs = opts.inputs or Path(info["input_roots"][0])  # absolute, as the worker's
        if not os.access(inputs, os.W_OK | os.X_OK):
            raise FramewireError(
                f"this process cannot write the worker's input root {inputs} (where the "
                "demo puts its reference video): pass --inputs DIR, a directory under one "
                "of the worker's input roots that this process can write",
                code="demo_failed",
            )
        client = stack.enter_context(Client(url, token=opts.token))
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"

        t0 = time.perf_counter()
        clips = [synthetic_clip(opts.frames, opts.height, opts.width, seed) for seed in (0, 1)]
        shape = "x".join(str(n) for n in clips[0].shape)
        mib = clips[0].nbytes / (1 << 20)
        table.add("make 2 clips", f"(3,T,H,W) {shape} float32, {mib:.1f} MiB each", _ms(t0))

        t0 = time.perf_counter()
        paths = [f"framewire-demo/{stamp}-{k}.mp4" for k in ("a", "b")]
        results = client.save_videos(clips, paths, fps=opts.fps)
        wall = _ms(t0)
        for result in results:
            table.add(
                f"  {Path(result.path).name}",
                f"{result.bytes or 0:,} bytes, route {result.route}, "
                f"sha256 {(result.sha256 or '')[:12]}",
                result.timings.encode_ms,
            )
        table.add("save_videos: 2 outputs", f"under {Path(results[0].path).parent}", wall)
        routes = {"fd": "as sealed memfds over the fd socket (no /dev/shm name)",
               "shm": "as named /dev/shm segments (no fd socket reachable)"}  # fmt: skip
        table.add("  frames handed over", routes[client.host_route])
        streamed, watch_url = stream_clip(
            client, clips[0], f"framewire-demo/{stamp}-a-streamed.mp4", opts
        )
        same = streamed.sha256 == results[0].sha256
        table.add(
            f"open_video: {-(-opts.frames // opts.chunk)} chunks of {opts.chunk} frames",
            f"{Path(streamed.path).name}: "
            + ("the same bytes as save_video" if same else "DIFFERENT bytes from save_video"),
            streamed.timings.encode_ms,
        )
        table.add("  its live view", f"{watch_url} (while it ran)")

        t0 = time.perf_counter()
        reference = make_reference(
            inputs / f"framewire-demo-{stamp}.mp4",
            width=opts.width,
            height=opts.height,
            fps=opts.fps,
            frames=opts.frames,
        )
        stack.callback(reference.unlink, missing_ok=True)
        table.add("reference video", f"{reference} (ffmpeg testsrc2)", _ms(t0))

        decodes_before = _decodes_run(url, opts.token)
        t0 = time.perf_counter()
        outcomes = decode_in_processes(
            reference,
            fd_socket,
            opts.ranks,
            fps=opts.fps,
            width=opts.width,
            height=opts.height,
        )
        wall = _ms(t0)
        for o in outcomes:
            if o.error:
                table.add(f"  rank {o.rank} (pid {o.pid})", f"failed: {o.error}", o.ms)
            else:
                how = "from the cache" if o.cached else "decoded or joined a decode"
                table.add(
                    f"  rank {o.rank} (pid {o.pid})",
                    f"{o.frames} frames via {o.source}, {how}, sha256 {o.sha256[:12]}",
                    o.ms,
                )
        agree = all(not o.error for o in outcomes) and len({o.sha256 for o in outcomes}) == 1
        verdict = "every process got the same bytes" if agree else "the processes DISAGREE"
        table.add(f"decode_reference: {opts.ranks} processes", verdict, wall)
        decodes_after = _decodes_run(url, opts.token)
        if decodes_before is not None and decodes_after is not None:
            ran = decodes_after - decodes_before
            table.add("  ffmpeg decodes in the worker", f"{ran:.0f} for {opts.ranks} requests")
    table.add("total", "the demo's worker is stopped" if started_one else "", _ms(started))
    print(table.render())
    return 0 if agree and same else 1
