"""A low-latency HLS follower for tests and benchmarks: what a player does over HTTP,
without a decoder. It reads a live media playlist, fetches the init segment and then
each part as it is listed (a whole segment where its parts are no longer listed),
and asks for the next one with a blocking reload (``_HLS_msn``, ``_HLS_part``) until
``EXT-X-ENDLIST``. Every playlist it got is kept (for the RFC checker), and when
each piece arrived."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urljoin

import httpx

from tests.support.http import http_client

ATTRS = re.compile(r'([A-Z0-9-]+)=("[^"]*"|[^,]*)')


@dataclass
class Piece:
    msn: int
    part: int | None  # None: the whole segment
    uri: str
    frames_s: float  # its duration


def listed(text: str) -> tuple[str | None, list[Piece], int, bool]:
    """The init URI, the pieces a follower fetches in order (a segment's parts while
    they are listed, else the segment), the media sequence number of the last
    segment listed (whole or in parts), and whether the playlist has ended."""
    init, pieces, msn, parts, ended = None, [], 0, [], False
    for line in text.splitlines():
        if line.startswith("#EXT-X-MEDIA-SEQUENCE:"):
            msn = int(line.split(":", 1)[1])
        elif line.startswith("#EXT-X-MAP:"):
            init = dict(ATTRS.findall(line))["URI"].strip('"')
        elif line.startswith("#EXT-X-PART:"):
            a = dict(ATTRS.findall(line))
            parts.append(Piece(msn, len(parts), a["URI"].strip('"'), float(a["DURATION"])))
        elif line.startswith("#EXTINF:"):
            duration = float(line[8:].split(",")[0])
            pieces.append(Piece(msn, None, "", duration))
        elif line == "#EXT-X-ENDLIST":
            ended = True
        elif line and not line.startswith("#"):
            segment = pieces.pop()
            if parts:
                pieces += parts
            else:
                pieces.append(Piece(msn, None, line, segment.frames_s))
            parts, msn = [], msn + 1
    pieces += parts  # of the segment being written
    return init, pieces, msn if parts else msn - 1, ended


@dataclass(eq=False)  # a thread: hashed by identity
class Follower(threading.Thread):
    """Follows ``url`` on its own thread from the oldest segment kept (``edge``: from
    the newest), until the playlist ends or ``stop`` is set."""

    url: str
    edge: bool = False
    timeout_s: float = 60.0
    playlists: list[str] = field(default_factory=list)
    init: bytes = b""
    got: dict[tuple[int, int | None], bytes] = field(default_factory=dict)
    arrived: list[tuple[int, int | None, float]] = field(default_factory=list)
    error: BaseException | None = None
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        super().__init__(daemon=True)

    def run(self) -> None:
        try:
            with http_client(timeout=self.timeout_s) as http:
                self._follow(http)
        except BaseException as exc:
            self.error = exc

    def _follow(self, http: httpx.Client) -> None:
        query, done, last = "", set(), None
        while not self.stop.is_set():
            r = http.get(self.url + query)
            r.raise_for_status()
            self.playlists.append(r.text)
            init, pieces, _, ended = listed(r.text)
            if init is not None and not self.init:
                self.init = self._get(http, init)
            if self.edge and last is None and pieces:
                newest = pieces[-1].msn
                pieces = [p for p in pieces if p.msn == newest]
            for piece in pieces:
                key = (piece.msn, piece.part)
                if key in done or (piece.part is None and (piece.msn, 0) in done):
                    continue
                if (piece.msn, None) in done:
                    continue
                if piece.part is None:  # its parts are gone from the list: the whole
                    for k in [k for k in self.got if k[0] == piece.msn]:
                        del self.got[k]
                self.got[key] = self._get(http, piece.uri)
                self.arrived.append((piece.msn, piece.part, time.monotonic()))
                done.add(key)
                last = piece
            if ended:
                return
            if last is None:
                query = ""
                continue
            msn, part = (last.msn + 1, 0) if last.part is None else (last.msn, last.part + 1)
            query = f"{'&' if '?' in self.url else '?'}_HLS_msn={msn}&_HLS_part={part}"

    def _get(self, http: httpx.Client, uri: str) -> bytes:
        r = http.get(urljoin(self.url, uri))
        r.raise_for_status()
        return r.content

    def media(self) -> bytes:
        """The init segment and every piece, in order: one fragmented MP4."""
        return self.init + b"".join(self.got[k] for k in sorted(self.got, key=_order))

    def result(self, timeout: float = 60) -> Follower:
        self.join(timeout)
        assert not self.is_alive(), "the follower did not reach the playlist's end"
        if self.error is not None:
            raise self.error
        return self


def _order(key: tuple[int, int | None]) -> tuple[int, int]:
    return key[0], -1 if key[1] is None else key[1]
