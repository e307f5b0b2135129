"""The process's client of the worker: made from the environment, bounded in how long
it waits for the worker, and holding the worker to the files it says it wrote.

``FRAMEWIRE_URL`` and ``FRAMEWIRE_TOKEN`` name the worker. One client per process, made
at the first routed save and made again in a forked child (a client's connections and
fd socket are its parent's). It never encodes locally unless FRAMEWIRE_LOCAL_FALLBACK=1:
with no worker the engine's own function runs, with its own bytes and dependencies.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import numpy as np
from framewire.client import Client, FramewireError, OutputResult
from framewire.integrations._switch import Declined

INFO_TTL_S = 30.0  # the worker's roots, asked again after this long (or a restart)
TIMEOUT_ENV = "FRAMEWIRE_INTEGRATION_TIMEOUT_S"
# How long a routed save waits for any answer of the worker (a chunk read, the finish):
# longer than the worker's own bound on an ffmpeg that makes no progress (60 s), so a
# worker that is alive says what went wrong first.
DEFAULT_TIMEOUT_S = 90.0
CHUNK_FRAMES = 8  # frames of a caller's list stacked at a time
CHUNK_BYTES = 64 << 20  # a tensor's frames handed over at a time


class Mismatch(Exception):
    """The worker said it wrote an output that is not there, or not as it said."""


class Silent(Exception):
    """The worker did not answer within the bound a moment ago: not asked again yet."""


def timeout_s() -> float:
    try:
        value = float(os.environ.get(TIMEOUT_ENV, "") or DEFAULT_TIMEOUT_S)
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return value if value > 0 else DEFAULT_TIMEOUT_S


def timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` came of the worker not answering within the bound."""
    seen: BaseException | None = exc
    for _ in range(8):  # a cause chain: stream_lost <- unavailable <- httpx's timeout
        if seen is None:
            return False
        if isinstance(seen, httpx.TimeoutException | TimeoutError):  # HTTP, the fd socket
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class Worker:
    """The process's client of the worker, and what the worker lets it write."""

    def __init__(self) -> None:
        self._made_for: tuple[int, str, str | None, bool, float] | None = None
        self._client: Client | None = None
        self._roots: list[str] = []
        self._roots_at = -INFO_TTL_S
        self._silent_until: dict[str, float] = {}  # by url
        self._lock = threading.Lock()

    @staticmethod
    def url() -> str:
        return os.environ.get("FRAMEWIRE_URL") or "http://127.0.0.1:7700"

    def client(self) -> Client:
        """The client (the same one until the process forks or the settings change);
        :class:`Silent` while a worker that timed out is left alone."""
        url = self.url()
        if time.monotonic() < self._silent_until.get(url, 0.0):
            raise Silent(f"the worker did not answer within {timeout_s():g} s a moment ago")
        token = os.environ.get("FRAMEWIRE_TOKEN") or None
        bound = timeout_s()
        wanted = (os.getpid(), url, token, self.local, bound)
        with self._lock:
            if self._client is None or self._made_for != wanted:
                # A forked child drops its parent's client without closing it: closing
                # would close the parent's fd socket under it.
                timeout = httpx.Timeout(bound, connect=min(bound, 10.0))
                self._client = Client(url, token=token, timeout=timeout, local_fallback=self.local)
                self._made_for, self._roots_at = wanted, -INFO_TTL_S
            return self._client

    def went_silent(self) -> None:
        """The worker let a save wait past the bound: the next saves for as long again
        run the engine's own function without waiting on it."""
        self._silent_until[self.url()] = time.monotonic() + timeout_s()

    @property
    def local(self) -> bool:
        """FRAMEWIRE_LOCAL_FALLBACK=1: with no worker, framewire encodes in this process
        (its local route, with the engine's own encoder, asked by identity as from a
        worker) instead of running the engine's function."""
        return os.environ.get("FRAMEWIRE_LOCAL_FALLBACK", "") == "1"

    def output_roots(self) -> list[str]:
        """The worker's absolute output roots (asked again every INFO_TTL_S)."""
        client = self.client()
        if time.monotonic() - self._roots_at >= INFO_TTL_S:
            info = client.info()
            roots = [str(r) for r in info.get("output_roots", [])]
            self._roots = [os.path.realpath(r) for r in roots if os.path.isabs(r)]
            self._roots_at = time.monotonic()
        return self._roots

    def target(self, path: str | os.PathLike[str]) -> str:
        """``path`` made absolute as the engine would open it (from this process's working
        directory); Declined unless it lies under one of the worker's output roots."""
        absolute = os.path.abspath(os.fspath(path))
        real = os.path.realpath(absolute)
        try:
            roots = self.output_roots()
        except FramewireError:
            if self.local:
                return absolute  # no worker to ask: the local route writes where the engine would
            raise
        for root in roots:
            if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
                return absolute
        raise Declined("the path is outside the worker's output roots")


WORKER = Worker()


def checked(target: str, result: OutputResult) -> OutputResult:
    """``result`` once the output it names is as the worker said: the file at ``target``
    (the bytes it sent back, for a ``memory://`` output) of its size and sha256."""
    if target.startswith("memory://"):
        # The client took them from a sealed memfd hashed as it was read
        # (framewire.core.fdsocket.take_output): other bytes would have raised there.
        data = result.data
        if data is None or len(data) != result.bytes:
            raise Mismatch("the worker sent back other bytes than it encoded")
        return result
    digest = hashlib.sha256()
    try:
        with open(target, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            while block := f.read(1 << 20):
                digest.update(block)
    except OSError as exc:
        raise Mismatch(f"the worker's file is not at the path ({exc.strerror})") from None
    if size != result.bytes or digest.hexdigest() != result.sha256:
        raise Mismatch("the file at the path is not the one the worker reported")
    return result


def save_tensors(
    targets: Sequence[str],
    videos: Sequence[Any],
    options: dict[str, Any],
    audios: Sequence[Any] | None = None,
) -> list[OutputResult]:
    """(3, T, H, W) tensors to ``targets``, each output checked. Host tensors in one save:
    over two chunks, the client hands them over chunk by chunk (never a copy of a clip
    here), the outputs side by side under the worker's admission. CUDA tensors one output
    after another, each a stream session fed CHUNK_BYTES at a time over CUDA IPC: every
    answer of the worker then comes within the bound, however long the clip."""
    client = WORKER.client()
    audios = list(audios) if audios is not None else [options.get("audio")] * len(videos)
    rest = {k: v for k, v in options.items() if k != "audio"}
    if not any(v.device.type == "cuda" for v in videos):
        results = client.save_videos(
            list(videos), list(targets), audio=audios, layout="CTHW", **rest
        )
    else:
        results = []
        for target, video, audio in zip(targets, videos, audios, strict=True):
            step = max(1, CHUNK_BYTES // (video[:, 0].numel() * video.element_size()))
            with client.open_video(target, layout="CTHW", audio=audio, **rest) as writer:
                for t0 in range(0, int(video.shape[1]), step):
                    writer.write(video[:, t0 : t0 + step])
            assert writer.result is not None
            results.append(writer.result)
    return [checked(t, r) for t, r in zip(targets, results, strict=True)]


# Writes one (H, W, 3) frame's 8-bit RGB into ``out`` (uint8, the frame's shape).
Into = Callable[[np.ndarray, np.ndarray], None]


def copied(frame: np.ndarray, out: np.ndarray) -> None:
    """8-bit frames as they are."""
    out[...] = frame


def write_frames(
    target: str, frames: Sequence[Any], into: Into = copied, **options: Any
) -> OutputResult:
    """A list of (H, W, 3) frames (arrays, or what numpy makes one of) to ``target``
    through a stream session, CHUNK_FRAMES at a time, each frame written by ``into``
    into one chunk reused for every group (the writer has copied a chunk when ``write``
    returns): the list is never stacked whole and no frame's conversion allocates (the
    bytes are save_video's of the stack); the output checked. Every frame exists already:
    the worker holds none ahead (``ahead=False``), and takes each chunk from the chunk
    buffer as it is (never copied there)."""
    first = np.asarray(frames[0])  # a PIL image's conversion is a copy: made once
    shape = first.shape
    chunk = np.empty((min(CHUNK_FRAMES, len(frames)), *shape), np.uint8)
    with WORKER.client().open_video(target, layout="THWC", ahead=False, **options) as writer:
        for t0 in range(0, len(frames), CHUNK_FRAMES):
            group = frames[t0 : t0 + CHUNK_FRAMES]
            for i, f in enumerate(group):
                frame = first if t0 + i == 0 else np.asarray(f)
                if frame.shape != shape:  # as np.stack would refuse them
                    raise ValueError("the frames are not all of one shape")
                into(frame, chunk[i])
            writer.write(chunk[: len(group)])
    assert writer.result is not None
    return checked(target, writer.result)
