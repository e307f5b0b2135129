"""The local fallback: a save that finds no worker is encoded in this process.

An engine's own save path writes its file whatever happens to a worker, so a
client that adopted framewire must too: when no worker can be reached, saves and
streams run the worker's own encoder here, with the same bytes and memory bounded
by the chunk, and their results say ``route == "local"``. The encoder is the
service's, found through the core's seam (``framewire.core.local``) on first
need, so the client imports without the ``service`` extra; where it is missing
the save raises the worker's :class:`Unavailable`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from framewire.client._calls import per_output
from framewire.core.errors import Unavailable
from framewire.core.frames import Frames
from framewire.core.local import LocalEncoding, LocalStream, local_encoder
from framewire.core.wire import OutputResult

log = logging.getLogger("framewire.client")

# What says no worker can take the call now: none reached (a transport failure), or one
# that is shutting down (a rolling update). Anything else is the worker's answer.
# What sends a save to the local fallback: no worker, one stopping, or one whose GPU a
# sticky CUDA error made unusable until it restarts (the rank's own GPU still works).
WORKER_GONE = frozenset({"unavailable", "shutting_down", "cuda_device_unusable"})


def worker_gone(exc: BaseException) -> bool:
    return isinstance(exc, Unavailable) and exc.code in WORKER_GONE


def _here(exc: Unavailable, paths: Sequence[str | os.PathLike[str]]) -> None:
    """Raise ``exc`` for outputs only a worker can write: object URLs (the store and its
    credentials are the worker's)."""
    if any("://" in os.fspath(p) for p in paths):
        raise exc


class LocalFallback:
    """Encodes here while the worker is out of reach; warns once per outage."""

    def __init__(self, output_root: str | os.PathLike[str] | None):
        self.output_root = output_root
        self._encoder: LocalEncoding | None = None
        self._lock = threading.Lock()
        self._in_outage = False

    def close(self) -> None:
        """The local encoder's held binaries and writers go with the client."""
        with self._lock:
            encoder, self._encoder = self._encoder, None
        if encoder is not None:
            encoder.close()

    def recovered(self) -> None:
        """A worker answered: the next outage is warned about again."""
        self._in_outage = False

    def _take(self, exc: Unavailable) -> LocalEncoding:
        """The local encoder, once the outage is noted; raises ``exc`` without one."""
        with self._lock:
            if self._encoder is None:
                try:
                    self._encoder = local_encoder(self.output_root)
                except ImportError as missing:
                    raise Unavailable(
                        f"{exc.message}; no local encoder either ({missing}): "
                        "install framewire[service] for the local fallback",
                        code=exc.code,
                    ) from exc
            encoder = self._encoder
            if not self._in_outage:
                self._in_outage = True
                # The message, not the exception: a record kept by a handler would keep its
                # traceback, and with it the socket httpx failed to connect.
                log.warning(
                    "framewire worker unreachable (%s); encoding in this process", exc.message
                )
        return encoder

    def save_videos(
        self,
        exc: Unavailable,
        videos: Sequence[Any],
        paths: Sequence[str | os.PathLike[str]],
        options: dict[str, Any],
        layout: Any,
    ) -> list[OutputResult]:
        _here(exc, paths)
        encoder = self._take(exc)
        audios = per_output(options.get("audio"), len(paths), "audio")
        return [
            encoder.save(video, path, options | {"audio": audio}, layout)
            for video, path, audio in zip(videos, paths, audios, strict=True)
        ]

    def open(
        self,
        exc: Unavailable,
        path: str | os.PathLike[str],
        options: dict[str, Any],
        first: Frames,
    ) -> LocalStream:
        _here(exc, [path])
        return self._take(exc).open(path, options, first)
