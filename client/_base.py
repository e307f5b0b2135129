"""What the two clients share: settings, request building, answer reading (no I/O)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import httpx
from framewire.client._calls import per_output
from framewire.client._reference import ReferenceFrames, fetch
from framewire.client._route import HostRoute
from framewire.client._sharing.audio import shared_audio
from framewire.client.wire import DecodeRequest

DEFAULT_URL = "http://127.0.0.1:7700"
DEFAULT_TIMEOUT = httpx.Timeout(3600.0, connect=10.0)

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


class BaseClient:
    """Settings, request building and answer reading: all of a client but its I/O."""

    def __init__(
        self,
        url: str,
        *,
        fd_socket: str | os.PathLike[str] | None,
        token: str | None,
        timeout: float | httpx.Timeout,
    ):
        self.url = url
        self.fd_socket = fd_socket  # None: FRAMEWIRE_FD_SOCKET, else the worker's default
        # One knob for both sockets: an fd-socket request may wait as long as an HTTP read.
        self.fd_timeout = timeout.read if isinstance(timeout, httpx.Timeout) else timeout
        self._route = HostRoute(fd_socket, self.fd_timeout)
        self._uds: str | None = None
        if url.startswith("unix://"):
            self._base_url, self._uds = "http://framewire", url.removeprefix("unix://")
        else:
            self._base_url = url.rstrip("/")
        self._client_args: dict[str, Any] = {
            "base_url": self._base_url,
            "headers": {"authorization": f"Bearer {token}"} if token else {},
            "timeout": timeout,
        }

    @staticmethod
    def _check_pairs(videos: Sequence[Any], paths: Sequence[Any]) -> None:
        if len(videos) != len(paths):
            raise ValueError(f"{len(videos)} videos for {len(paths)} paths")

    def _share_audio(
        self, stack: contextlib.ExitStack, audio: Any, sample_rate: int | None, n: int
    ) -> list[Any]:
        """Each output's ``audio`` as the wire has it: paths as they are, samples shared
        (on the fd route when the client has it) until ``stack`` closes."""
        regions = self._route.regions
        return [
            stack.enter_context(shared_audio(a, sample_rate, regions))
            for a in per_output(audio, n, "audio")
        ]

    @property
    def host_route(self) -> str:
        """How host frames reach the worker now: ``"fd"`` (descriptors over the fd socket)
        or ``"shm"`` (named POSIX shm segments, before the fd route was tried or when it
        is not to be had)."""
        return self._route.name

    def _fetch(self, request: DecodeRequest, local_fallback: bool) -> ReferenceFrames:
        # The fd route's socket once it is known (the one /v1/info named), else as configured.
        regions = self._route.regions
        path = self.fd_socket or (regions.path if regions is not None else None)
        return fetch(request, path, local_fallback=local_fallback, timeout=self.fd_timeout)


def twin(original: Callable[..., Any]) -> Callable[[F], F]:
    """Give an AsyncClient method the docstring of its Client twin."""

    def apply(method: F) -> F:
        method.__doc__ = original.__doc__
        return method

    return apply
