"""Judging an encode request's outputs before anything is made, then placing them.

Every output is judged first (its path, whether the caller may write there, its
audio, its source opened and checked), and only then are directories made: a
refused request leaves nothing behind. Placing an output opens its directory
without following links and claims its name, so two writers never race for one
file.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from framewire.core.errors import BadRequest, Conflict
from framewire.core.media.inputs import InputFile
from framewire.core.wire import (
    AudioSource,
    CudaIpcSource,
    EncodeOptions,
    OutputSpec,
    RegionSource,
    ShmAudio,
    ShmSource,
    Source,
)
from framewire.service._access.paths import (
    nearest_directory,
    open_input,
    open_output_dir,
    real_roots,
    resolve_output,
)
from framewire.service._access.peers import READ, SEARCH, WRITE, Access
from framewire.service._access.urls import ObjectUrl, is_url
from framewire.service._encode.encoders import Encoders
from framewire.service._encode.params import EncodeParams, check_geometry, check_params
from framewire.service._outputs import NO_DIRECTORY
from framewire.service._settings import Settings
from framewire.service._sources.audio import MemoryAudio
from framewire.service._sources.audio_store import AudioStore
from framewire.service._sources.cuda_shares import Shares
from framewire.service._sources.cuda_versions import importable
from framewire.service._sources.frames import FileSource, FrameSource, Geometry, MappedSource
from framewire.service._sources.regions import CudaRegion, FdRegion, RegionRegistry, SystemRegion
from framewire.service._sources.shm import open_shm
from framewire.service._store.handoff import MemoryTarget
from framewire.service._store.spool import discard

if TYPE_CHECKING:
    from framewire.service._sources.cuda_ipc import CudaRuntime
    from framewire.service._store.uploads import Early, Target, Uploads


@dataclass
class Prepared:
    spec: OutputSpec
    path: Path
    source: FrameSource
    params: EncodeParams
    url: Target | None = None  # an object output (``path``: its spool file) or a memory one
    directory: int = -1  # fd of path's directory, opened without following links
    made: list[Path] = field(default_factory=list)  # directories made for it, outermost first
    early: Early | None = None  # an object's parts sent, a memory output's copy made

    @property
    def shown(self) -> str:  # the output as its caller named it
        return str(self.url or self.path)


def _geometry(src: ShmSource | RegionSource) -> Geometry:
    return Geometry(src.dtype, src.layout, src.frames, src.height, src.width)


class OutputClaims:
    """The outputs being written now, by (device, directory inode, name).

    Two writers of one file would each rename theirs into place, and the answer
    of the one renamed first would describe a file that is gone: the second
    asks while the first writes and gets 409 ``output_busy``. Event loop only.
    """

    def __init__(self) -> None:
        self._held: set[tuple[object, ...]] = set()

    def claim(self, directory: int, name: str, stack: contextlib.AsyncExitStack) -> None:
        st = os.fstat(directory)
        self._claim((st.st_dev, st.st_ino, name), f"{name!r} in that directory", stack)

    def claim_url(self, url: ObjectUrl, stack: contextlib.AsyncExitStack) -> None:
        self._claim(("s3", url.bucket, url.key), str(url), stack)

    def _claim(self, key: tuple[object, ...], what: str, stack: contextlib.AsyncExitStack) -> None:
        if key in self._held:
            raise Conflict(f"another encode is writing {what} now", code="output_busy")
        self._held.add(key)
        stack.callback(self._held.discard, key)


@dataclass(eq=False)
class Preparer:
    """Turns an output spec into a :class:`Prepared` job: judged, opened, placed."""

    settings: Settings
    regions: RegionRegistry
    uploads: Uploads
    encoders: Encoders  # which binary a request's encoder identity names
    cuda: CudaRuntime | None = None  # None: no usable GPU, cuda_ipc sources are refused
    claims: OutputClaims = field(default_factory=OutputClaims, init=False)
    shares: Shares = field(default_factory=Shares)  # the producers' CUDA shares open now

    def __post_init__(self) -> None:
        budget = self.settings.audio_budget_bytes
        self.audio = AudioStore(budget, self.settings.per_user(budget))

    async def judge(
        self, spec: OutputSpec, access: Access, stack: contextlib.AsyncExitStack
    ) -> Prepared:
        """Everything about one output that can be refused, before anything is made."""
        path, params, url = await self.judge_options(spec, access, stack)
        check_geometry(params, spec.source.width, spec.source.height, spec.source.dtype)
        source = await self.open_source(spec.source, access, stack)
        return Prepared(spec, path, source, params, url)

    async def judge_options(
        self, options: EncodeOptions, access: Access, stack: contextlib.AsyncExitStack
    ) -> tuple[Path, EncodeParams, Target | None]:
        """Where the output goes (judged, nothing made; an object URL's spool file) and
        how it is encoded (the audio opened, closed with ``stack``)."""
        url: Target | None = None
        if is_url(options.path):
            # The allow-list and the object's owner judge the caller here; the spool is the
            # worker's own.
            target = await asyncio.to_thread(self.uploads.target, options.path, access)
            url, path = target
            if isinstance(url, ObjectUrl):  # a memory output is its request's alone
                self.claims.claim_url(url, stack)
        else:
            # Off the event loop: judging paths is the filesystem's time.
            path = await asyncio.to_thread(self._judge_path, options.path, access)
        audio: InputFile | None = None
        if isinstance(options.audio, str):
            audio = await asyncio.to_thread(self._open_input, options.audio, access)
        elif options.audio is not None:
            audio = await self._memory_audio(options.audio, options.profile, access)
        if audio is not None:
            stack.callback(audio.close)
        # A small output runs at the worker's own priority: jobs.py.
        ffmpeg = self.encoders.pick(options.encoder, options.profile)
        priority = self.settings.encode_priority
        params = EncodeParams.asked(options, audio, priority=priority, ffmpeg=ffmpeg)
        check_params(params)
        return path, params, url

    async def _memory_audio(self, src: AudioSource, profile: str, access: Access) -> MemoryAudio:
        """The samples ``src`` names, read now (the caller's memory is free again once the
        request is judged) into a WAV of the worker's own, shared with every output that
        names the same samples (``AudioStore``: one copy, within the audio budget)."""
        clamp = profile != "vllm-omni"  # SGLang clamps before its WAV; vLLM-omni never does
        if isinstance(src, ShmAudio):
            return await asyncio.to_thread(self._shm_audio, src, access, clamp)
        async with self.regions.lease(src.region, src.offset, src.byte_size, access) as region:
            if not isinstance(region, SystemRegion):
                raise BadRequest(
                    f"region {src.region!r} is GPU memory; audio is read from host memory",
                    code="bad_audio_source",
                )
            at = region.offset + src.offset
            return await asyncio.to_thread(
                self.audio.lease, src, region.fd, at, clamp=clamp, user=access.share_key
            )

    def _shm_audio(self, src: ShmAudio, access: Access, clamp: bool) -> MemoryAudio:
        fd = open_shm(src.key, self.settings.shm_prefixes)
        try:
            access.check(os.fstat(fd), READ, f"shm segment {src.key!r}")
            return self.audio.lease(src, fd, src.offset, clamp=clamp, user=access.share_key)
        finally:
            os.close(fd)

    def _judge_path(self, raw: str, access: Access) -> Path:
        roots = self.settings.output_roots
        path = resolve_output(raw, roots)
        # Where the file, or the first directory made for it, lands: the caller must be
        # able to write there. (A root gone missing fails the open later: a 503.)
        parent = nearest_directory(path.parent)
        if any(parent.is_relative_to(root) for root in real_roots(roots)):
            access.check_path(parent, real_roots(roots), WRITE | SEARCH, raw)
        return path

    def _open_input(self, raw: str, access: Access) -> InputFile:
        roots = self.settings.input_roots
        opened = open_input(raw, roots)
        try:
            access.check_path(Path(opened.name), real_roots(roots), READ, raw, os.fstat(opened.fd))
        except BaseException:
            opened.close()
            raise
        return opened

    async def open_source(
        self, src: Source, access: Access, stack: contextlib.AsyncExitStack
    ) -> FrameSource:
        """The frames ``src`` names, opened for the caller (closed with ``stack``)."""
        source = await self._open_source(src, access, stack)
        if source.close_in_thread:
            stack.push_async_callback(asyncio.to_thread, source.close)
        else:
            stack.callback(source.close)
        return source

    async def _open_source(
        self, src: Source, access: Access, stack: contextlib.AsyncExitStack
    ) -> FrameSource:
        if isinstance(src, ShmSource):
            # Off the event loop: opening and checking a file is the filesystem's time.
            return await asyncio.to_thread(self._open_shm, src, access)
        if isinstance(src, RegionSource):
            region = await stack.enter_async_context(
                self.regions.lease(src.region, src.offset, src.byte_size, access)
            )
            if isinstance(region, FdRegion) and region.mapping is not None:
                offset = region.offset + src.offset
                return MappedSource(region.mapping, region.fd, offset, _geometry(src))
            if isinstance(region, SystemRegion):
                offset = region.offset + src.offset
                return FileSource(region.fd, offset, _geometry(src), owns_fd=False)
            assert isinstance(region, CudaRegion) and self.cuda is not None
            return self.cuda.region_source(region, src)
        assert isinstance(src, CudaIpcSource)
        handle = importable(src.handle_bytes, src.torch_version)  # before any CUDA call
        if handle != src.handle_bytes:
            src = src.model_copy(update={"handle": base64.b64encode(handle).decode()})
        self.shares.opening(src.share_id)  # refused if its producer was told to release it
        stack.callback(self.shares.closed, src.share_id)  # after the source's own close
        if self.cuda is None:
            raise BadRequest(
                "this worker has no CUDA device; send host memory instead",
                code="cuda_unavailable",
            )
        # Opening a handle is driver work (milliseconds): off the event loop. A request
        # cancelled meanwhile waits for the open, and closes what it opened, before its
        # share counts as closed: a release must never be answered while a thread maps it.
        opening = asyncio.ensure_future(asyncio.to_thread(self.cuda.open_ipc, src))
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.to_thread((await opening).close)
            raise

    def _open_shm(self, src: ShmSource, access: Access) -> FileSource:
        fd = open_shm(src.key, self.settings.shm_prefixes)
        try:
            access.check(os.fstat(fd), READ, f"shm segment {src.key!r}")
            return FileSource(fd, src.offset, _geometry(src))
        except BaseException:
            os.close(fd)
            raise

    async def place(self, job: Prepared, access: Access, stack: contextlib.AsyncExitStack) -> None:
        """Make and open the output's directory and claim its name (all judged before)."""
        job.directory = await self.place_at(job.path, job.made, access, stack, job.url)

    async def place_at(
        self,
        path: Path,
        made: list[Path],
        access: Access,
        stack: contextlib.AsyncExitStack,
        url: Target | None,
    ) -> int:
        """The directory of ``path`` made for ``access``'s caller (``made`` lists what was)
        and opened, its name claimed; both released with ``stack``. An object output's
        (``url``) directory is the worker's spool, checked as it is opened, and its file is
        removed with ``stack``; a memory output has none (NO_DIRECTORY): its memfd is its
        request's alone."""
        if isinstance(url, MemoryTarget):
            return NO_DIRECTORY
        roots = self.settings.output_roots
        spooled = url is not None
        if spooled:
            directory = await asyncio.to_thread(self.uploads.spool.open)
        else:
            directory = await asyncio.to_thread(open_output_dir, path, roots, made, access.peer)
        stack.callback(os.close, directory)
        if spooled:  # whatever happens, before the fd is closed
            stack.push_async_callback(asyncio.to_thread, discard, directory, path.name)
        self.claims.claim(directory, path.name, stack)
        return directory
