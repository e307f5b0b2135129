"""What the two clients share: settings, request building, answer reading, and each
operation as a plan (client._plan) that either client runs its own way."""

from __future__ import annotations

import abc
import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import httpx
from framewire.client._calls import (
    INSTANCE_HEADER,
    Call,
    encode_call,
    info_call,
    per_output,
    unreachable,
)
from framewire.client._chunked import chunked
from framewire.client._chunked import save_plan as chunked_save
from framewire.client._handover import Handover
from framewire.client._local import LocalFallback, worker_gone
from framewire.client._peer import PeerCheck, tls_for
from framewire.client._plan import Plan, blocking, sent
from framewire.client._release import DeferredReleases
from framewire.client._sharing import share
from framewire.client._sharing.audio import shared_audio
from framewire.client._sharing.cuda import NotShareable
from framewire.client._sharing.fd import FdRegions
from framewire.client._stream import StreamPlans
from framewire.core.errors import Unavailable
from framewire.core.fdsocket import take_output
from framewire.core.frames import Frames, describe
from framewire.core.reference import ReferenceFrames, fetch
from framewire.core.trust import trust_remote as trust_remote_env
from framewire.core.trust import worker_uids
from framewire.core.wire import DecodeRequest, Layout, OutputResult

DEFAULT_URL = "http://127.0.0.1:7700"
DEFAULT_TIMEOUT = httpx.Timeout(3600.0, connect=10.0)
# An idle pooled connection is dropped after this long, well before the worker closes it
# (FRAMEWIRE_IDLE_TIMEOUT_S, 30 s by default): a call never races the worker's close.
KEEPALIVE_S = 2.0

T = TypeVar("T")
H = TypeVar("H", httpx.Client, httpx.AsyncClient)
W = TypeVar("W", bound="StreamPlans[Any]")  # the twin's stream writer
F = TypeVar("F", bound=Callable[..., Any])


class BaseClient(abc.ABC, Generic[H, W]):
    """Settings, request building, answer reading and the plan of each operation: all of
    a client but its I/O (its connection pool, ``H``)."""

    def __init__(
        self,
        url: str | None = None,
        *,
        fd_socket: str | os.PathLike[str] | None = None,
        token: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        local_fallback: bool = True,
        output_root: str | os.PathLike[str] | None = None,
        worker_uid: int | None = None,
        trust_remote: bool = False,
    ):
        url = url or os.environ.get("FRAMEWIRE_URL", DEFAULT_URL)  # the CLI's default too
        self.url = url
        self.fd_socket = fd_socket  # None: FRAMEWIRE_FD_SOCKET, else the worker's default
        # One knob for both sockets: an fd-socket request may wait as long as an HTTP read.
        self.fd_timeout = timeout.read if isinstance(timeout, httpx.Timeout) else timeout
        # Every socket is checked to be the worker's user's before anything goes to it.
        self.worker_uid = worker_uid
        self._handover = Handover(fd_socket, self.fd_timeout, worker_uid)
        self._uds: str | None = None
        if url.startswith("unix://"):
            self._base_url, self._uds = "http://framewire", url.removeprefix("unix://")
        else:
            self._base_url = url.rstrip("/")
        # A worker on another host cannot be checked: it gets the token only over https,
        # or when the caller says it may (trust_remote, FRAMEWIRE_TRUST_REMOTE).
        remote_ok = url.startswith("https://") or not token or trust_remote or trust_remote_env()
        limits = httpx.Limits(keepalive_expiry=KEEPALIVE_S)
        self._peer = PeerCheck(worker_uids(worker_uid), remote_ok, limits, tls_for(url))
        self._client_args: dict[str, Any] = {
            "base_url": self._base_url,
            "headers": {"authorization": f"Bearer {token}"} if token else {},
            "timeout": timeout,
            "limits": limits,
        }
        # Saves and streams that find no worker are encoded here (docs/api.md).
        self._local = LocalFallback(output_root) if local_fallback else None
        self.instance: str | None = None  # the worker process that answered last
        self._http: H = self._open_http()
        # CUDA shares a call left without an answer: released once the worker has let go.
        self._release_later = DeferredReleases(
            lambda: httpx.Client(transport=self._peer.transport(self._uds), **self._client_args)
        )

    @abc.abstractmethod
    def _open_http(self) -> H:
        """The connection pool, whose connections are checked as they are made."""

    def _answer(self, call: Call[T], response: httpx.Response) -> T:
        """Read an answer, noting which worker gave it."""
        self.instance = response.headers.get(INSTANCE_HEADER, self.instance)
        if self._local is not None:
            self._local.recovered()
        return call.answer(response)

    def _sending(self, call: Call[T]) -> Plan[T]:
        """``call`` sent (each step a request of the client's transport), and its answer.
        A request that failed is sent once more, on a fresh connection, when it may be
        (the pool dropped the connection it used: ``Call.resendable``)."""
        resent = False
        while True:
            try:
                response: httpx.Response = yield call
            except httpx.TransportError as exc:
                if resent or not call.resendable(exc):
                    raise unreachable(exc) from exc
                resent = True
                continue
            return self._answer(call, response)

    def _falls_back(self, exc: Unavailable) -> LocalFallback | None:
        """The local fallback, when it takes a call that failed with ``exc``."""
        return self._local if self._local is not None and worker_gone(exc) else None

    def _share_audio(
        self, stack: contextlib.ExitStack, audio: Any, sample_rate: int | None, n: int
    ) -> list[Any]:
        """Each output's ``audio`` as the wire has it: paths as they are, samples shared
        (on the fd handover when the client has it) until ``stack`` closes."""
        regions = self._handover.regions
        return [
            stack.enter_context(shared_audio(a, sample_rate, regions))
            for a in per_output(audio, n, "audio")
        ]

    @staticmethod
    def _encode_call(
        sources: list[Any],
        audios: list[Any],
        paths: Sequence[str | os.PathLike[str]],
        options: dict[str, Any],
    ) -> Call[list[OutputResult]]:
        """The encode request of shared ``sources`` and ``audios`` (the save's ``options``)."""
        fields = {k: v for k, v in options.items() if k not in ("audio", "audio_sample_rate")}
        return encode_call(sources, audios, paths, **fields)

    def _handover_plan(self) -> Plan[None]:
        """Bring the fd handover up to date for the worker that answers now. Looking at
        the connection does not block, and is all a call does as a rule; connecting
        (again) is a blocking step."""
        handover = self._handover
        if handover.stale():
            yield from blocking(handover.refresh)
        if not handover.current(self.instance):
            info = yield from sent(info_call())
            yield from blocking(handover.connect, info)

    def _regions_plan(self) -> Plan[FdRegions | None]:
        """The fd handover a stream's chunk buffers are registered on (None: segments)."""
        yield from self._handover_plan()
        return self._handover.regions

    _writer_type: type[W]  # VideoWriter or AsyncVideoWriter
    _send: Any  # the twin's way of taking a call: returned, or awaited

    def _writer(
        self,
        path: str | os.PathLike[str],
        options: dict[str, Any],
        layout: Layout | str | None,
        live: bool = False,
        ahead: bool = True,
    ) -> W:
        """A stream writer of this client's (its twin's kind) for one output."""
        return self._writer_type(
            self._send,
            self._regions_plan,
            self._local,
            path,
            options,
            layout=layout,
            live=live,
            ahead=ahead,
            release_later=self._release_later,
        )

    def _save_plan(
        self,
        videos: Sequence[Any],
        paths: Sequence[str | os.PathLike[str]],
        options: dict[str, Any],
        layout: Layout | str | None,
    ) -> Plan[list[OutputResult]]:
        if len(videos) != len(paths):
            raise ValueError(f"{len(videos)} videos for {len(paths)} paths")
        described = _described(videos, layout)
        if described is not None and chunked(described):  # never a whole copy of the clip
            return (yield from self._chunked_plan(described, paths, options))
        try:
            yield from self._handover_plan()
            with contextlib.ExitStack() as stack:  # closed here on a failure or a cancellation
                sources = yield from self._share_videos(stack, videos, layout)
                audios = yield from blocking(
                    self._share_audio,
                    stack,
                    options["audio"],
                    options["audio_sample_rate"],
                    len(paths),
                )
                results = yield from sent(self._encode_call(sources, audios, paths, options))
                return (yield from blocking(self._end_save, stack, results))
        except NotShareable:
            if described is None:
                raise
            # CUDA frames torch will not share (nothing was sent): through the host, a
            # chunk at a time, as stream sessions (each chunk counted by the worker).
            return (yield from self._chunked_plan(described, paths, options))
        except Unavailable as exc:
            local = self._falls_back(exc)
            if local is None:
                raise
            return (yield from blocking(local.save_videos, exc, videos, paths, options, layout))

    def _chunked_plan(
        self,
        described: list[Frames],
        paths: Sequence[str | os.PathLike[str]],
        options: dict[str, Any],
    ) -> Plan[list[OutputResult]]:
        """Each output a stream session, written a chunk at a time (client/_chunked.py)."""
        audios = per_output(options["audio"], len(paths), "audio")
        # The frames all exist: a chunk answered before ffmpeg took it gains nothing.
        writers = [
            self._writer(p, options | {"audio": a}, f.layout, ahead=False)
            for p, f, a in zip(paths, described, audios, strict=True)
        ]
        return (yield from chunked_save(writers, described, [os.fspath(p) for p in paths]))

    def _share_videos(
        self, stack: contextlib.ExitStack, videos: Sequence[Any], layout: Layout | str | None
    ) -> Plan[list[Any]]:
        """Each video's descriptor, shared until ``stack`` closes."""
        sources = []
        for video in videos:
            # share() runs here, where the caller's CUDA stream is current; entering it
            # (the copy into shared memory, the stream wait) is a blocking step.
            shared = share(
                video,
                layout=layout,
                regions=self._handover.regions,
                release_later=self._release_later,
            )
            sources.append((yield from blocking(stack.enter_context, shared)))
        return sources

    def _decode_plan(self, request: DecodeRequest, local_fallback: bool) -> Plan[ReferenceFrames]:
        return (yield from blocking(self._fetch, request, local_fallback))

    @property
    def host_route(self) -> str:
        """How host frames reach the worker now: ``"fd"`` (descriptors over the fd socket)
        or ``"shm"`` (named POSIX shm segments, before the fd handover was tried or when it
        is not to be had)."""
        return self._handover.name

    def _fd_path(self) -> str | os.PathLike[str] | None:
        """The fd socket: as configured, else the one the handover found (else the default)."""
        regions = self._handover.regions
        return self.fd_socket or (regions.path if regions is not None else None)

    def _end_save(
        self, stack: contextlib.ExitStack, results: list[OutputResult]
    ) -> list[OutputResult]:
        """Release what a save shared, then take its outputs' bytes (one blocking step)."""
        stack.close()
        return self._take_data(results)

    def _take_data(self, results: list[OutputResult]) -> list[OutputResult]:
        """Take the bytes of each ``memory://`` output into its result's ``data``, checked
        against its sha256 as they are read."""
        for result in results:
            if result.handoff is not None and result.data is None:
                result.data = take_output(
                    result.handoff,
                    self._fd_path(),
                    self.fd_timeout,
                    worker_uid=self.worker_uid,
                    sha256=result.sha256,
                )
        return results

    def _fetch(self, request: DecodeRequest, local_fallback: bool) -> ReferenceFrames:
        return fetch(
            request,
            self._fd_path(),
            local_fallback=local_fallback,
            timeout=self.fd_timeout,
            worker_uid=self.worker_uid,
        )


def _described(videos: Sequence[Any], layout: Layout | str | None) -> list[Frames] | None:
    """What each video is; None when one is not a video (the save says why, in its turn)."""
    try:
        return [describe(v, layout) for v in videos]
    except (ValueError, TypeError, AttributeError):
        return None


def save_options(
    fps: float,
    quality: float | None,
    preset: str | None,
    threads: int | None,
    audio: Any,
    audio_sample_rate: int | None,
    profile: str,
    value_range: tuple[float, float] | None,
    presign_s: int | None,
    validate: bool,
    encoder: str | None = None,
) -> dict[str, Any]:
    """A save's keywords, as the worker's request and the local fallback both take them."""
    return {
        "fps": fps,
        "quality": quality,
        "preset": preset,
        "threads": threads,
        "audio": audio,
        "audio_sample_rate": audio_sample_rate,
        "profile": profile,
        "value_range": value_range,
        "presign_s": presign_s,
        "validate": validate,
        "encoder": encoder,
    }


def twin(original: Callable[..., Any]) -> Callable[[F], F]:
    """Give an AsyncClient method the docstring of its Client twin."""

    def apply(method: F) -> F:
        method.__doc__ = original.__doc__
        return method

    return apply
