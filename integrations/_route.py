"""What every engine integration shares: whether it is on, the process's client, which
paths the worker may write, and the engine's own function whenever framewire cannot
give its bytes.

The engine's process is not ours to configure, so everything comes from the
environment: ``FRAMEWIRE_INTEGRATIONS`` (which integrations act), ``FRAMEWIRE_URL``
and ``FRAMEWIRE_TOKEN`` (the worker). One client per process, made at the first
routed save and made again in a forked child (a client's connections and fd socket
are its parent's). It never encodes locally: with no worker the engine's own
function runs, with its own bytes and dependencies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from framewire.client import Client, FramewireError, OutputResult

ENV = "FRAMEWIRE_INTEGRATIONS"
NAMES = ("sglang", "vllm-omni", "diffusers")
INFO_TTL_S = 30.0  # the worker's roots, asked again after this long (or a restart)

log = logging.getLogger("framewire.integrations")
T = TypeVar("T")

_counts: Counter[str] = Counter()
_said: set[str] = set()
_lock = threading.Lock()


def enabled(name: str) -> bool:
    """Whether ``FRAMEWIRE_INTEGRATIONS`` (comma-separated, or ``all``) names ``name``."""
    asked = {n.strip().lower() for n in os.environ.get(ENV, "").split(",") if n.strip()}
    return name in asked or "all" in asked


def counts() -> dict[str, int]:
    """Saves of this process by where they went: ``<engine>:routed`` through the worker,
    ``<engine>:engine:<why>`` to the engine's own function."""
    with _lock:
        return dict(_counts)


def count(key: str) -> None:
    with _lock:
        _counts[key] += 1


def say_once(key: str, message: str, *args: object, level: int = logging.INFO) -> None:
    """Log ``message`` the first time ``key`` is seen in this process."""
    with _lock:
        if key in _said:
            return
        _said.add(key)
    log.log(level, message, *args)


class Declined(Exception):
    """This save is not one framewire reproduces: the engine's own function runs."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


class Worker:
    """The process's client of the worker, and what the worker lets it write."""

    def __init__(self) -> None:
        self._made_for: tuple[int, str, str | None, bool] | None = None  # pid, url, token, local
        self._client: Client | None = None
        self._roots: list[str] = []
        self._roots_at = -INFO_TTL_S
        self._lock = threading.Lock()

    def client(self) -> Client:
        url = os.environ.get("FRAMEWIRE_URL") or "http://127.0.0.1:7700"
        token = os.environ.get("FRAMEWIRE_TOKEN") or None
        wanted = (os.getpid(), url, token, self.local)
        with self._lock:
            if self._client is None or self._made_for != wanted:
                # A forked child drops its parent's client without closing it: closing
                # would close the parent's fd socket under it.
                self._client = Client(url, token=token, local_fallback=self.local)
                self._made_for, self._roots_at = wanted, -INFO_TTL_S
            return self._client

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
CHUNK_FRAMES = 8  # frames of a caller's list stacked at a time
CHUNK_BYTES = 64 << 20  # a host tensor's frames handed over at a time


def save_tensors(targets: Sequence[str], videos: Sequence[Any], options: dict[str, Any],
                 audios: Sequence[Any] | None = None) -> None:  # fmt: skip
    """(3, T, H, W) tensors to ``targets``, all at once (the worker encodes them in
    parallel under its admission). CUDA tensors go whole over CUDA IPC; host tensors
    through stream sessions, CHUNK_BYTES at a time, so this process never holds a copy
    of a clip (a whole host clip would be copied into shared memory once)."""
    client = WORKER.client()
    audios = list(audios) if audios is not None else [options.get("audio")] * len(videos)
    rest = {k: v for k, v in options.items() if k != "audio"}
    if all(v.device.type == "cuda" for v in videos):
        client.save_videos(list(videos), list(targets), audio=audios, **rest)
        return
    with contextlib.ExitStack() as stack:
        writers = [
            stack.enter_context(client.open_video(t, layout="CTHW", audio=a, **rest))
            for t, a in zip(targets, audios, strict=True)
        ]
        step = min(max(1, CHUNK_BYTES // (v[:, 0].numel() * v.element_size())) for v in videos)
        for t0 in range(0, max(int(v.shape[1]) for v in videos), step):  # round robin
            for writer, video in zip(writers, videos, strict=True):
                if t0 < video.shape[1]:
                    writer.write(video[:, t0 : t0 + step])


def write_frames(
    target: str,
    frames: Sequence[Any],
    convert: Callable[[Any], np.ndarray] = np.asarray,
    **options: Any,
) -> OutputResult:
    """A list of (H, W, 3) frames to ``target`` through a stream session, CHUNK_FRAMES
    at a time: the list is never stacked whole (the bytes are save_video's of the stack)."""
    with WORKER.client().open_video(target, layout="THWC", **options) as writer:
        for t0 in range(0, len(frames), CHUNK_FRAMES):
            writer.write(np.stack([convert(f) for f in frames[t0 : t0 + CHUNK_FRAMES]]))
    assert writer.result is not None
    return writer.result


def route(
    engine: str,
    routed: Callable[[], T],
    original: Callable[..., T],
    args: Sequence[Any],
    kwargs: dict[str, Any],
) -> T:
    """``routed()`` through the worker; when it declines or the worker fails, the
    engine's ``original(*args, **kwargs)`` (its bytes, its errors), said once per cause."""
    try:
        result = routed()
    except Declined as exc:
        why, level, said = exc.why, logging.INFO, exc.why
    except FramewireError as exc:  # no worker, another encoder, a refusal
        why = f"the worker answered {exc.code}"
        level, said = logging.WARNING, f"{why} ({exc.message})"
    except Exception as exc:  # framewire's own failure must not fail a save the engine can do
        why = f"framewire failed ({type(exc).__name__})"
        level, said = logging.WARNING, f"{why}: {exc}"
        log.debug("framewire: the routed %s save failed", engine, exc_info=True)
    else:
        count(f"{engine}:routed")
        return result
    count(f"{engine}:engine:{why}")
    say_once(f"{engine}:{why}", "framewire: a %s save runs the engine's own code: %s",
             engine, said, level=level)  # fmt: skip
    return original(*args, **kwargs)
