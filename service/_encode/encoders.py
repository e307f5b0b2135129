"""The encoders a worker can run, each named by its identity; a request may ask for one.

The default ffmpeg (``FRAMEWIRE_FFMPEG``, else imageio-ffmpeg's) runs every
request that names none. ``FRAMEWIRE_ENCODERS`` adds binaries (the ones the
engines served here pin), and PyAV is the ``vllm-omni`` profile's encoder. A
request naming an identity the worker does not hold is refused (409
``encoder_unavailable``), never served by another build: its bytes would differ.

Each binary is opened once, refused at the start if another user could change it,
and run from its descriptor (core/media/binary.py): a binary whose path later names
another file, or nothing, still runs the bytes its identity names. Each encoder's
colours are checked at the start (core/media/colours.py): an added one that fails is
left out, a default that fails stops the start. One that stops running later (its
libraries removed) is refused by name while the others serve.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable

from framewire.core.errors import Conflict, FramewireError, Unavailable
from framewire.core.media import colours
from framewire.core.media.binary import Binary
from framewire.core.media.identity import PYAV, pyav_identity
from framewire.core.media.process import resolve_ffmpeg
from framewire.service._ops.versions import RunCheck, ffmpeg_version
from framewire.service._probe import pyav, pyav_build

log = logging.getLogger("framewire.encode")

# x264 writes its build into the stream it makes (an SEI message), e.g.
# "x264 - core 164 r3095 baee400": the one place a binary says which libx264 it runs.
_X264 = re.compile(rb"x264 - core (\d+)(?: r(\d+))?(?: ([0-9a-f]+))? -")

# Colour checks by identity, once per process (tests and the zygote build many workers).
_checked: dict[str, colours.ColourCheck] = {}
_checked_lock = threading.Lock()


def x264_build(stream: bytes) -> str | None:
    """``core N[ rNNNN hash]`` from an H.264 stream x264 wrote, or None."""
    found = _X264.search(stream)
    if found is None:
        return None
    core, rev, commit = found.groups()
    build = f"core {core.decode()}"  # some builds name no revision
    if rev:
        build += f" r{rev.decode()}"
    return f"{build} {commit.decode()}" if commit else build


def colour_check(binary: Binary) -> colours.ColourCheck:
    """The binary's colour check (two runs of it, about 25 ms), once per identity."""
    identity = binary.identity()
    with _checked_lock:
        found = _checked.get(identity)
    if found is None:
        found = colours.check_ffmpeg(binary.exe)
        if found.ok:  # a failure is asked again: it may have been the host's, for once
            with _checked_lock:
                _checked[identity] = found
    return found


def pyav_check() -> colours.ColourCheck | None:
    """PyAV's colour check (in this process, about 5 ms), once; None without PyAV."""
    av = pyav()
    if av is None:
        return None
    with _checked_lock:
        found = _checked.get(PYAV)
    if found is None:
        found = colours.check_pyav(av)
        with _checked_lock:
            _checked[PYAV] = found
    return found


class Encoders:
    """The ffmpeg binaries (the default first) and PyAV, by identity."""

    def __init__(self, default: str | None = None, extra: list[str] | None = None):
        paths = [resolve_ffmpeg(default)] + [resolve_ffmpeg(p) for p in extra or []]
        self.binaries: list[Binary] = []
        self.extra: list[Binary] = []  # held for other uses (the decoder's), not encodes
        self.refused: list[str] = []  # why each encoder left out at the start was
        self.on_refusal: Callable[[], None] = lambda: None  # the worker counts refusals
        self._checks: dict[str, RunCheck] = {}
        self._lost: set[str] = set()  # paths of binaries that stopped running
        self._unchecked: set[str] = set()  # paths of binaries whose colours are not known
        self._refused: dict[str, str] = {}  # paths of ones found wrong since: why
        try:
            # The default first, each file once; each refused if another user could change it.
            for path in dict.fromkeys(os.path.realpath(p) for p in paths):
                self.binaries.append(Binary(path))
            self._check_colours()
        except BaseException:
            self.close()
            raise
        self.default = self.binaries[0].exe  # what runs a request that names no encoder
        self.default_path = self.binaries[0].path
        pyav_ok = pyav_check()
        self.pyav_ok = pyav_ok is not None and pyav_ok.ok
        if pyav_ok is not None and not pyav_ok.ok:
            self._leave_out(f"PyAV {pyav_build()}: its colours are wrong: {pyav_ok.problem}")

    def _check_colours(self) -> None:
        for binary in list(self.binaries):
            check = colour_check(binary)
            if not check.ran:  # not ready until it runs; checked when it first does
                self._unchecked.add(binary.path)
                log.warning("the encoder %s does not run: %s", binary.path, check.problem)
            elif not check.ok:
                why = self._wrong(binary, check)
                if binary is self.binaries[0]:
                    raise Unavailable(f"refusing {why}", code="encoder_colours")
                self.binaries.remove(binary)
                binary.close()
                self._leave_out(why)

    @staticmethod
    def _wrong(binary: Binary, check: colours.ColourCheck) -> str:
        return (
            f"the encoder {binary.path} ({binary.identity()}): its colours are wrong: "
            f"{check.problem}"
        )

    def _leave_out(self, why: str) -> None:
        log.error("left out %s", why)
        self.refused.append(why)

    def held(self, path: str) -> Binary:
        """The binary at ``path``: one already held, else opened (and held) now."""
        real = os.path.realpath(path)
        for binary in self.binaries:
            if binary.path == real:
                return binary
        binary = Binary(real)
        self.extra.append(binary)
        return binary

    def check(self, binary: Binary) -> RunCheck:
        found = self._checks.get(binary.path)
        if found is None:
            found = self._checks.setdefault(binary.path, RunCheck(binary.exe))
        return found

    def runs(self, binary: Binary, *, again: bool = False) -> bool:
        """Whether ``binary`` runs now (asked at most once per RUNS_TTL_S, or now:
        ``again``); logs each change of answer once."""
        ok = self.check(binary).runs(again=again) and self._colours_known(binary)
        if ok == (binary.path not in self._lost):
            return ok
        if ok:
            self._lost.discard(binary.path)
            log.warning("the encoder %s runs", binary.path)
        else:
            self._lost.add(binary.path)
            log.error("the encoder %s does not run: %s; refusing it", binary.path, self.why(binary))
        return ok

    def _colours_known(self, binary: Binary) -> bool:
        """An encoder that did not run at the start is checked when it first does."""
        if binary.path in self._unchecked:
            check = colour_check(binary)
            if check.ran:
                self._unchecked.discard(binary.path)
                if not check.ok:
                    self._refused[binary.path] = self._wrong(binary, check)
                    self._leave_out(self._refused[binary.path])
        return binary.path not in self._unchecked and binary.path not in self._refused

    def why(self, binary: Binary) -> str:
        """Why ``binary`` is refused, when :meth:`runs` said it does not run."""
        return self._refused.get(binary.path) or self.check(binary).why or "it does not run"

    def lost(self) -> int:
        """How many held binaries stopped running (as last asked): a metric."""
        return len(self._lost)

    def by_identity(self) -> dict[str, Binary]:
        found: dict[str, Binary] = {}
        for binary in self.binaries:
            found.setdefault(binary.identity(), binary)  # one binary twice: its first
        return found

    def pick(self, asked: str | None, profile: str) -> str | None:
        """The ffmpeg executable for a request that asks for ``asked`` (None: the default;
        the vllm-omni profile runs PyAV, so it has no executable); raises 409
        ``encoder_unavailable`` for an identity not held here, or one that stopped running."""
        if profile == "vllm-omni":
            held = self.pyav_id()
            refused = pyav() is not None and not self.pyav_ok  # its colours were wrong
            if refused or (asked is not None and asked != held):
                self._refuse(asked or PYAV, [held] if held else [])
            return None  # without PyAV, the encode answers 503 pyav_missing
        binaries = self.by_identity()
        if asked is None:
            binary = self.binaries[0]
        elif asked in binaries:
            binary = binaries[asked]
        else:
            self._refuse(asked, list(binaries))
        # Only one known not to run is asked again (has it come back?): a healthy encode
        # starts no process but its own. One that stops running is found by its encode's
        # failure (explain).
        known_lost = binary.path in self._lost or binary.path in self._unchecked
        if known_lost and not self.runs(binary):
            raise self._not_running(binary)
        return binary.exe

    def _not_running(self, binary: Binary) -> FramewireError:
        if binary is self.binaries[0]:  # the worker is not ready: 503
            return Unavailable(
                f"the default encoder {binary.path} does not run: {self.why(binary)}",
                code="ffmpeg_missing",
            )
        self.on_refusal()
        return Conflict(
            f"the encoder {binary.identity()} ({binary.path}) does not run: {self.why(binary)}",
            code="encoder_unavailable",
        )

    def explain(self, exe: str, failure: FramewireError) -> FramewireError:
        """What an encode whose ``exe`` failed with ``failure`` is answered with: that the
        encoder does not run (asked now: 409, or 503 for the default) where it no longer
        does, else ``failure`` itself."""
        binary = next((b for b in self.binaries if b.exe == exe), None)
        if binary is None or failure.code != "ffmpeg_failed" or self.runs(binary, again=True):
            return failure
        return self._not_running(binary)

    @staticmethod
    def pyav_version() -> str | None:
        """The PyAV this worker imported (and names); a writer must import the same."""
        build = pyav_build()
        return None if build is None else build["version"]

    def pyav_id(self) -> str | None:
        build = pyav_build()
        return None if build is None or not self.pyav_ok else pyav_identity(build["version"])

    def _refuse(self, asked: str, held: list[str]) -> None:
        self.on_refusal()
        kind = "PyAV" if asked.startswith(PYAV) else "ffmpeg"
        holds = ", ".join(held) or "none"
        raise Conflict(
            f"this worker holds no {kind} encoder {asked!r} (it holds: {holds})",
            code="encoder_unavailable",
        )

    def describe_binary(self, binary: Binary) -> dict[str, object]:
        identity = binary.identity()
        about: dict[str, object] = {
            "id": identity,
            "kind": "ffmpeg",
            "path": binary.path,
            "sha256": identity.split(":", 1)[1],
            "default": binary is self.binaries[0],
            "available": self.runs(binary),
        }
        if not about["available"]:
            return about | {"why": self.why(binary)}
        try:
            version: str | None = ffmpeg_version(binary.exe, identity)
        except FramewireError:
            version = None  # stopped running since the check just now
        return about | {
            "version": version,
            "libx264": x264_build(colour_check(binary).stream),
        }

    def describe(self) -> list[dict[str, object]]:
        """Every encoder, as ``/v1/info`` reports it (the default first)."""
        out = [self.describe_binary(binary) for binary in self.by_identity().values()]
        build, check = pyav_build(), pyav_check()
        if build is not None and check is not None:
            out.append(
                {"id": pyav_identity(build["version"]), "kind": "pyav", **build}
                | {"available": check.ok, "libx264": x264_build(check.stream)}
            )
        return out

    def close(self) -> None:
        for binary in [*self.binaries, *self.extra]:
            binary.close()
