"""Reference frames: a decode mapped from a sealed memfd, from the worker or decoded here.

The worker decodes each distinct (file, fps, size, start, cap) once per host and
sends every caller a descriptor of the same sealed memfd; mapping it shares the
physical pages. When no worker answers, the same command runs here into a
private memfd, so the bytes never depend on which way they came.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import numpy as np
from framewire.core.closing import Closing
from framewire.core.decode import DecodeRun, decode_to_memfd
from framewire.core.errors import FramewireError, Unavailable
from framewire.core.fdsocket import DEFAULT_TIMEOUT, FdSocket, default_fd_socket, error_from
from framewire.core.media.process import find_ffmpeg
from framewire.core.trust import NOT_TRUSTED
from framewire.core.wire import DecodeRequest, refusal
from pydantic import ValidationError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("framewire.client")

Source = Literal["worker", "local"]
REQUIRED_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK


class ReferenceFrames(Closing):
    """``(T, H, W, 3)`` uint8 frames over a sealed memfd, mapped shared and read-only.

    ``frames`` is a read-only numpy view: no copy, the pages are the ones every
    other rank on the host maps. :meth:`writable` and :meth:`torch` give
    copy-on-write views (a page is copied only when written). :meth:`close`
    unmaps; views still alive elsewhere keep their pages until they are dropped.
    """

    def __init__(
        self,
        fd: int,
        *,
        frames: int,
        height: int,
        width: int,
        cached: bool = False,
        decode_ms: float = 0.0,
        source: Source = "worker",
    ):
        """Takes ownership of ``fd`` (closed by :meth:`close`, or here on error)."""
        self.shape = (frames, height, width, 3)
        self.nbytes = frames * height * width * 3
        self.cached = cached
        self.decode_ms = decode_ms
        self.source: Source = source
        try:
            size = os.fstat(fd).st_size
            if size != self.nbytes or self.nbytes <= 0:
                raise FramewireError(
                    f"memfd holds {size} bytes, header says {self.shape}", code="protocol"
                )
            # Unsealed pages could shrink under the mapping (SIGBUS) or change under a reader.
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if seals & REQUIRED_SEALS != REQUIRED_SEALS:
                raise FramewireError("the frames' memfd is not sealed", code="protocol")
            self._map: mmap.mmap | None = mmap.mmap(fd, self.nbytes, access=mmap.ACCESS_READ)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd  # kept for the copy-on-write mappings of writable()
        self._frames: np.ndarray | None = np.frombuffer(self._map, np.uint8).reshape(self.shape)

    @property
    def frames(self) -> np.ndarray:
        if self._frames is None:
            raise ValueError("reference frames are closed")
        return self._frames

    @property
    def closed(self) -> bool:
        return self._map is None

    def __len__(self) -> int:
        return self.shape[0]

    def writable(self) -> np.ndarray:
        """A writable copy-on-write view: writes stay private to this array."""
        if self._map is None:
            raise ValueError("reference frames are closed")
        private = mmap.mmap(self._fd, self.nbytes, access=mmap.ACCESS_COPY)
        # The array keeps the private mapping alive; it is unmapped when the array goes.
        return np.frombuffer(private, np.uint8).reshape(self.shape)

    def torch(self) -> torch.Tensor:
        """A ``(T, H, W, 3)`` uint8 CPU tensor without a copy.

        Built on a copy-on-write view: torch has no read-only tensors, and an
        in-place op on the shared read-only pages would crash the process.
        """
        import torch

        return torch.from_numpy(self.writable())

    def close(self) -> None:
        """Unmap and release the memfd. Idempotent."""
        self._frames = None
        if self._map is not None:
            m, self._map = self._map, None
            try:
                m.close()
            except BufferError:
                pass  # views still exported: the mapping goes with the last of them
            os.close(self._fd)
            self._fd = -1

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"cached={self.cached}"
        return f"ReferenceFrames(shape={self.shape}, source={self.source!r}, {state})"


def make_request(
    path: str | os.PathLike[str],
    *,
    fps: float,
    width: int,
    height: int,
    start: float = 0.0,
    max_frames: int | None = None,
    decoder: str | None = None,
) -> DecodeRequest:
    """The validated request. Paths become absolute here, so the worker and a local
    fallback read the same file. ``decoder``: the identity of the ffmpeg the frames must
    come from (a worker running another answers ``encoder_unavailable``)."""
    try:
        return DecodeRequest(
            path=os.path.abspath(os.fspath(path)),
            fps=fps,
            width=width,
            height=height,
            start=start,
            max_frames=max_frames,
            decoder=decoder,
        )
    except ValidationError as exc:
        # The fd socket's code for every refused request: the same whichever way it went.
        raise refusal(exc, code="bad_request") from None


def decode_from_worker(
    request: DecodeRequest,
    fd_socket: str | os.PathLike[str] | None = None,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
    worker_uid: int | None = None,
) -> ReferenceFrames:
    """Ask the worker; raises :class:`Unavailable` when it cannot be reached."""
    with FdSocket(fd_socket or default_fd_socket(), timeout, worker_uid=worker_uid) as conn:
        reply, fd = conn.call(request.model_dump(mode="json"))
    if not reply.ok:
        if fd is not None:
            os.close(fd)
        raise error_from(reply)
    if fd is None or reply.frames is None:
        if fd is not None:
            os.close(fd)
        raise FramewireError("the worker answered without frames", code="protocol")
    return ReferenceFrames(
        fd,
        frames=reply.frames,
        height=request.height,
        width=request.width,
        cached=bool(reply.cached),
        decode_ms=reply.decode_ms or 0.0,
        source="worker",
    )


def decode_locally(
    request: DecodeRequest,
    ffmpeg: str | None = None,
    *,
    started: Callable[[DecodeRun], None] | None = None,
) -> ReferenceFrames:
    """The same decode in this process, into a private sealed memfd (``started``: as
    :func:`~framewire.core.decode.decode_to_memfd` takes it)."""
    decoded = decode_to_memfd(ffmpeg or find_ffmpeg(), request.path, request, started=started)
    return ReferenceFrames(
        decoded.fd,
        frames=decoded.frames,
        height=request.height,
        width=request.width,
        decode_ms=decoded.decode_ms,
        source="local",
    )


def decode_reference(
    path: str | os.PathLike[str],
    *,
    fps: float,
    width: int,
    height: int,
    start: float = 0.0,
    max_frames: int | None = None,
    fd_socket: str | os.PathLike[str] | None = None,
    local_fallback: bool = True,
    timeout: float | None = DEFAULT_TIMEOUT,
    decoder: str | None = None,
    worker_uid: int | None = None,
) -> ReferenceFrames:
    """The frames of one reference decode: from the worker, else (if allowed) decoded here.

    Only an unreachable worker leads to the local decode; an answer of the worker
    (bad request, forbidden, not found, decode failed, overloaded) is raised, and so
    is a socket served by another user than the worker's (``worker_uid``, else
    FRAMEWIRE_WORKER_UID, else this process's: ``worker_not_trusted``).
    """
    request = make_request(
        path,
        fps=fps,
        width=width,
        height=height,
        start=start,
        max_frames=max_frames,
        decoder=decoder,
    )
    return fetch(
        request, fd_socket, local_fallback=local_fallback, timeout=timeout, worker_uid=worker_uid
    )


def fetch(
    request: DecodeRequest,
    fd_socket: str | os.PathLike[str] | None = None,
    *,
    local_fallback: bool = True,
    timeout: float | None = DEFAULT_TIMEOUT,
    worker_uid: int | None = None,
) -> ReferenceFrames:
    """:func:`decode_reference` of a request already made (``make_request``)."""
    try:
        return decode_from_worker(request, fd_socket, timeout=timeout, worker_uid=worker_uid)
    except Unavailable as exc:
        # Someone else on the worker's socket is no outage to decode around: it is said.
        if not local_fallback or exc.code == NOT_TRUSTED:
            raise
        log.info("framewire worker unreachable (%s); decoding %s locally", exc, request.path)
    return decode_locally(request)
