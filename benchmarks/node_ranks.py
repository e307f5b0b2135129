"""The processes of benchmarks/node.py: a node's ranks, the prober, and what measures them.

A rank is a process started once per rank count, holding its own float32 clip
and a connected ``Client``; for each run it is told the path, gets ready, waits
for the common start (one ``multiprocessing.Event`` for all ranks) and saves its
clip that way:

  bare      the encode argv reading the rank's rgb24 file in /dev/shm (routes.bare)
  imageio   the clip converted whole, ``imageio.mimsave`` (encode.imageio_save), and
            beside it (a thread) the reference decoded in the rank, by an ffmpeg of its
            own, as an engine without the worker decodes it (none with ``--reference
            none``)
  pipe      8-frame chunks converted in process and written into its own ffmpeg's
            stdin, the shape of SGLang's direct save (stream.in_process_ffmpeg), the
            rank's own decode beside it
  save      ``save_video``, and beside it the reference decode through the worker: one
            ffmpeg run shared by every rank
  stream    ``open_video`` and a ``write`` per 8 frames, the decode beside it

The prober issues, every ~50 ms, a ``GET /healthz`` on the Unix socket and a
tiny encode (2 frames 64x48) through its own ``Client``, each in its own thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import numpy as np
from encode import FPS, clip_chunk, imageio_save, status_kib
from routes import bare
from stream import in_process_ffmpeg, to_rgb24

TINY = (2, 48, 64)  # frames, height, width of the probe's encodes
TINY_SIZE = f"{TINY[2]}x{TINY[1]}".encode()  # its ffmpegs' "-s": not the ranks' encodes
PERIOD_S = 0.05
WORKER_PATHS = ("save", "stream")
DECODING = ("imageio", "pipe", *WORKER_PATHS)  # a reference decode beside the save


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    path.unlink()
    return digest


# ----------------------------------------------------------------------------- a rank


def rank(index: int, spec: dict[str, Any], conn: Connection, go: Event) -> None:
    import torch
    from framewire.client import Client
    from framewire.core.media.process import resolve_ffmpeg

    torch.set_num_threads(1)  # the imageio path's conversion: one thread, as x264's
    resolve_ffmpeg()  # imageio-ffmpeg's lookup runs `ffmpeg -version` once: not timed
    frames, height, width = spec["frames"], spec["height"], spec["width"]
    # The rank's generated clip, in its own memory (a private copy, touched).
    clip = np.fromfile(spec["segments"][index], np.float32).reshape(3, frames, height, width)
    outputs, threads, chunk = Path(spec["outputs"]), spec["threads"], spec["chunk"]
    with Client(spec["url"], fd_socket=spec["fd_socket"], local_fallback=False) as client:
        client.info()  # connected before any run
        conn.send("started")
        while (order := conn.recv()) is not None:
            path, run = order
            name = f"r{index}-{path}.mp4"
            out = outputs / name
            conn.send("ready")
            go.wait()
            got: list[str] = []  # the reference decode, at the same moment as the save
            decode = threading.Thread(target=reference, args=(client, spec, path, run, got))
            if spec["reference"] is not None and path in DECODING:
                decode.start()
            if path == "bare":
                digest = bare(Path(spec["rgbs"][index]), out, width, height, threads)["sha256"]
            elif path == "imageio":
                imageio_save(torch.from_numpy(clip), out, threads)
                digest = sha256_of(out)
            elif path == "pipe":
                ffmpeg = in_process_ffmpeg({"height": height, "width": width, "out": str(out),
                                            "threads": threads})  # fmt: skip
                assert ffmpeg.stdin is not None
                for t0 in range(0, frames, chunk):
                    ffmpeg.stdin.write(to_rgb24(clip[:, t0 : t0 + chunk]))
                ffmpeg.stdin.close()
                if ffmpeg.wait() != 0:
                    raise RuntimeError("the in-process ffmpeg failed")
                digest = sha256_of(out)
            else:
                if path == "save":
                    result = client.save_video(clip, name, fps=FPS, threads=threads)
                else:
                    with client.open_video(name, fps=FPS, threads=threads) as writer:
                        for t0 in range(0, frames, chunk):
                            writer.write(clip[:, t0 : t0 + chunk])
                    result = writer.close()
                assert result.sha256 is not None
                digest = result.sha256
                out.unlink()
            decoded = ""
            if spec["reference"] is not None and path in DECODING:
                decode.join()
                decoded = got[0] if got else "failed"
            done = time.monotonic()
            conn.send({"done": done, "sha256": digest, "decoded": decoded})


def reference(client: Any, spec: dict[str, Any], path: str, run: int, got: list[str]) -> None:
    """The run's reference decode, hashed: through the worker (one ffmpeg run for every
    rank) on the worker's paths, else by an ffmpeg of the rank's own."""
    ref = spec["reference"]
    if path not in WORKER_PATHS:
        got.append(local_decode(ref, run))
        return
    with client.decode_reference(
        ref["path"], fps=ref["fps"], width=ref["width"], height=ref["height"],
        start=ref["step_s"] * run, local_fallback=False,
    ) as frames:  # fmt: skip
        got.append(hashlib.sha256(frames.frames.reshape(-1)).hexdigest())


def local_decode(ref: dict[str, Any], run: int) -> str:
    """The sha256 of a run's reference decode, decoded in this process."""
    from framewire.core.reference import decode_locally, make_request

    request = make_request(ref["path"], fps=ref["fps"], width=ref["width"],
                           height=ref["height"], start=ref["step_s"] * run)  # fmt: skip
    with decode_locally(request) as frames:
        return hashlib.sha256(frames.frames.reshape(-1)).hexdigest()


# ----------------------------------------------------------------------------- the prober


def prober(spec: dict[str, Any], conn: Connection) -> None:
    import httpx
    from framewire.client import Client

    tiny = clip_chunk(0, TINY[0], TINY[1], TINY[2])
    outputs = Path(spec["outputs"])
    transport = httpx.HTTPTransport(uds=spec["uds"])
    with (
        httpx.Client(transport=transport, base_url="http://framewire", timeout=60) as http,
        Client(spec["url"], fd_socket=spec["fd_socket"], local_fallback=False) as client,
    ):
        client.info()
        made = [0]

        def health() -> None:
            http.get("/healthz").raise_for_status()

        def encode() -> None:
            made[0] += 1
            name = f"probe-{made[0]}.mp4"
            client.save_video(tiny, name, fps=FPS, threads=1)
            (outputs / name).unlink()

        health()  # warm: the connections, the first tiny encode
        encode()
        conn.send("started")
        while conn.recv() is not None:
            stop = threading.Event()
            loops = [Every(health, stop), Every(encode, stop)]
            for loop in loops:
                loop.start()
            conn.recv()  # "stop"
            stop.set()
            for loop in loops:
                loop.join()
            conn.send({"health_ms": loops[0].times_ms, "tiny_ms": loops[1].times_ms})


class Every(threading.Thread):
    """Calls ``fn`` every PERIOD_S (at once when the last call overran), timing each."""

    def __init__(self, fn: Any, stop: threading.Event):
        super().__init__(daemon=True)
        self.fn, self.stop, self.times_ms = fn, stop, []

    def run(self) -> None:
        due = time.monotonic()
        while True:  # once at least, however short the load
            started = time.perf_counter()
            self.fn()
            self.times_ms.append((time.perf_counter() - started) * 1e3)
            if self.stop.is_set():
                return
            due = max(due + PERIOD_S, time.monotonic())
            self.stop.wait(due - time.monotonic())


# ----------------------------------------------------------------------------- memory


class Memory(threading.Thread):
    """What the node's processes hold beyond their level at the start, sampled every 20 ms.

    In KiB: ``ranks`` and ``worker``: the sum over the ranks, and the worker's, peak
    private and file memory (RssAnon + RssFile) above the level at the start.
    ``encoders``: the sum of every encoder child's peak (VmHWM) under them (the
    prober's tiny encodes, by their ``-s``, and Python copies before exec are left
    out). ``shared``: the peak of the shared memory the ranks and the worker hold
    (memfds and /dev/shm segments open in them, each counted once, at its allocated
    size) above the level at the start, every 100 ms: a rank's copy of its clip lives
    for its whole request. Pages mapped from it are not counted again (RssShmem is left
    out of the processes' own figures for that reason).
    """

    OWN = ("RssAnon:", "RssFile:")

    def __init__(self, ranks: list[int], worker: int):
        super().__init__(daemon=True)
        self.parents, self.ranks, self.worker = [*ranks, worker], ranks, worker
        self.peaks: dict[int, int] = {}
        self._done = threading.Event()
        self._skip: set[int] = set()
        self._base = {pid: status_kib(str(pid), self.OWN)[1] for pid in self.parents}
        self._top = dict(self._base)
        # The staging the worker keeps between encodes is counted whole, whenever it was
        # made: it is memory the node holds for these saves.
        self._shared_base = self._shared(kept=False)
        self.shared_top = self._shared()

    def run(self) -> None:
        tick = 0
        while not self._done.wait(0.02):
            self._sample()
            tick += 1
            if tick % 5 == 0:
                self.shared_top = max(self.shared_top, self._shared())

    def _sample(self) -> None:
        for pid in self.parents:
            with contextlib.suppress(OSError):
                self._top[pid] = max(self._top[pid], status_kib(str(pid), self.OWN)[1])
        for parent in self.parents:
            for pid in _children(parent):
                if pid in self._skip:
                    continue
                try:
                    name, hwm = status_kib(str(pid), ("VmHWM:",))
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue  # gone
                if not name.startswith("ffmpeg"):
                    continue  # not yet exec'd (or not an encoder)
                if TINY_SIZE in argv:
                    self._skip.add(pid)
                    continue
                self.peaks[pid] = max(self.peaks.get(pid, 0), hwm)

    def _shared(self, kept: bool = True) -> int:
        """KiB allocated to the distinct memfds and /dev/shm files the processes hold (but
        the worker's kept staging unless ``kept``)."""
        seen: dict[tuple[int, int], int] = {}
        for pid in self.parents:
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    link = f"/proc/{pid}/fd/{fd}"
                    with contextlib.suppress(OSError):
                        name = os.readlink(link)
                        if not kept and name.startswith("/memfd:framewire-staging"):
                            continue
                        if name.startswith(("/memfd:", "/dev/shm/")):
                            st = os.stat(link)
                            seen[(st.st_dev, st.st_ino)] = st.st_blocks // 2
        return sum(seen.values())

    def stop(self) -> dict[str, int]:
        """Stops sampling; the three figures, KiB."""
        self._done.set()
        self.join()
        self._sample()
        self.shared_top = max(self.shared_top, self._shared())
        extra = {pid: self._top[pid] - self._base[pid] for pid in self.parents}
        return {
            "ranks": sum(extra[pid] for pid in self.ranks),
            "worker": extra[self.worker],
            "encoders": sum(self.peaks.values()),
            "shared": self.shared_top - self._shared_base,
        }


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            try:
                found += [int(p) for p in Path(task.path, "children").read_text().split()]
            except OSError:
                continue
    except OSError:
        pass
    return found
