"""An encoded output delivered where its URL names, and its spool file gone: uploaded to
object storage (``s3://``), or held in memory for its caller to take (``memory://``).

Runs after the encode has given back its CPU slots: an upload waits on the
network, not the cores, and runs on its own pool so it never takes an encode's
thread. A cancelled request (client gone, session aborted, shutdown past its
grace) stops the upload at its next part and aborts it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from framewire.core.errors import FramewireError, Stalled, Unavailable
from framewire.core.wire import OutputResult
from framewire.service._access.peers import Access
from framewire.service._access.urls import judge_url
from framewire.service._ops.threads import in_thread
from framewire.service._settings import Settings
from framewire.service._store.early import EarlyUpload
from framewire.service._store.handoff import SCHEME as MEMORY
from framewire.service._store.handoff import Handoffs, MemoryTarget, judge_memory
from framewire.service._store.memfile import MemoryHold
from framewire.service._store.multipart import Upload, Uploaded
from framewire.service._store.owners import OwnedUrl, judge_owner
from framewire.service._store.s3 import S3Store
from framewire.service._store.spool import Spool, discard

Target = OwnedUrl | MemoryTarget
# What follows an output while it is encoded, for what comes after the encode.
Early = EarlyUpload | MemoryHold

log = logging.getLogger("framewire.store")


class Uploads:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.store = S3Store(settings)
        self.spool = Spool(settings.output_roots)  # where they are encoded first
        # memory:// outputs, until their callers take them.
        self.handoffs = Handoffs(
            settings.held_output_ttl_s,
            max_held=settings.max_held_outputs,
            max_bytes=settings.held_output_bytes,
            per_user=settings.per_user,
        )
        self.pool = ThreadPoolExecutor(
            max(4, settings.cpu_slots * 2), thread_name_prefix="framewire-upload"
        )
        # Told each object upload's end: "ok", "cancelled", or the error's code.
        self.on_upload: Callable[[str], None] = lambda result: None

    def target(self, raw: str, access: Access) -> tuple[Target, Path]:
        """The object or memory output ``raw`` names, judged for ``access``'s caller (an
        object: by its prefix and its owner), and where it is encoded first: an object's
        spool file; a memory output's own name, as messages show it (it is encoded into
        its memfd: no spool, so no output root, is needed)."""
        if raw.startswith(MEMORY):
            memory = judge_memory(raw, access, self.settings)
            self.handoffs.admit(memory)
            return memory, Path(memory.name)
        allowed = judge_url(raw, self.settings.output_urls)
        # What is judged here first: a spool that is not the worker's asks no store.
        spooled = self.spool.file(allowed.suffix)
        try:
            found = self.store.found(allowed)
        except (Unavailable, Stalled):
            # The upload's own request says what the store answers; until then the
            # owner is unknown, so it may only create the object (If-None-Match).
            found = None
        return judge_owner(allowed, access, found), spooled

    def early(
        self,
        url: Target | None,
        cancel: threading.Event,
        on_failure: Callable[[FramewireError], None] = lambda exc: None,
    ) -> Early | None:
        """What follows the output while it is encoded: an object's parts sent meanwhile,
        a memory output's memfd that it is encoded into (None for a file); its owner closes
        it when the output ends."""
        if isinstance(url, MemoryTarget):
            return MemoryHold(url, self.handoffs)
        if not isinstance(url, OwnedUrl) or not self.settings.upload_while_encoding:
            return None
        try:
            client = self.store.client()
        except FramewireError:
            return None  # the upload after the encode says why
        up = Upload(client, url, cancel)
        return EarlyUpload(self.store.multipart, up, on_failure)

    async def deliver(
        self,
        result: OutputResult,
        spool: int,
        name: str,
        url: Target,
        presign_s: int | None,
        cancel: threading.Event,
        early: Early | None = None,
    ) -> OutputResult:
        """The result once the encoded file ``name`` in the spool open at ``spool`` is
        stored at ``url`` (raises what failed: nothing stored); it is removed either way.
        The file is reached through the spool's fd, never by path. ``early``: what sent
        its parts while it was encoded, or the memfd a memory output was encoded into (no
        spool file: ``spool`` and ``name`` are unused)."""
        if isinstance(url, MemoryTarget):
            hold = early if isinstance(early, MemoryHold) else None
            return self._hold(result, url, hold)
        early = early if isinstance(early, EarlyUpload) else None
        t0 = time.perf_counter()
        try:
            try:
                await in_thread(
                    self.pool, cancel, self._upload, spool, name, result, url, cancel, early
                )
            except FramewireError as exc:  # Cancelled's code is "cancelled"
                self.on_upload(exc.code)
                raise
            except asyncio.CancelledError:
                self.on_upload("cancelled")
                raise
            except Exception:
                self.on_upload("internal")
                raise
            self.on_upload("ok")
            presigned = None
            if presign_s is not None:
                presigned = await asyncio.to_thread(self.store.presign, url, presign_s)
        finally:
            await asyncio.to_thread(discard, spool, name)
        result.path = result.url = str(url)
        result.presigned_url = presigned
        result.timings.upload_ms = (time.perf_counter() - t0) * 1e3
        result.timings.finished_at = time.time()
        return result

    def _hold(
        self, result: OutputResult, url: MemoryTarget, hold: MemoryHold | None
    ) -> OutputResult:
        """Hold the output's bytes: the memfd it was encoded into (``hold``'s), held already
        under its session's reserved ticket, or now."""
        ticket = None if hold is None else hold.handed()
        if ticket is None:
            memfd = None if hold is None else hold.taken(result.bytes or 0)
            if memfd is None:  # a memory output is always encoded into its MemoryHold's
                raise FramewireError("the memory output's memfd is missing", code="internal")
            ticket, _ = self.handoffs.keep(memfd, result.bytes or 0, url)
        result.handoff = ticket
        result.path = result.url = str(url)
        result.timings.finished_at = time.time()
        return result

    def _upload(
        self,
        spool: int,
        name: str,
        result: OutputResult,
        url: OwnedUrl,
        cancel: threading.Event,
        early: EarlyUpload | None,
    ) -> Uploaded:
        assert result.bytes is not None and result.sha256 is not None
        fd = _open_spooled(spool, name)
        try:
            # From here the upload its early parts went to is the final upload's: it
            # completes it, or aborts it. Raises what stopped the early parts.
            started = None if early is None else early.handover()
            return self.store.upload(fd, result.bytes, result.sha256, url, cancel, started)
        finally:
            os.close(fd)

    def warm(self) -> None:
        """Make the store's client now; a worker that cannot says so in its log at start."""
        try:
            self.store.client()
        except FramewireError as exc:
            log.warning("object URL outputs will fail: %s", exc.message, extra={"code": exc.code})

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.store.close()
        self.handoffs.close()
        self.spool.close()


def _open_spooled(spool: int, name: str) -> int:
    return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=spool)
