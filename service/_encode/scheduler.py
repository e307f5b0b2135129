"""Admission control for encodes across every request the worker serves.

An encode holds its x264 thread count in CPU slots (capped at the slot count)
and, for CUDA sources, its conversion temporaries in GPU bytes on the device
that holds its frames, for as long as it runs. Encodes start in arrival order
as soon as what they hold fits; the rest wait in a bounded queue. Strict FIFO:
a big encode at the head is not starved by small ones slipping past it.

A small encode (its frames a few hundred KiB: see ``FRAMEWIRE_SMALL_ENCODE_BYTES``)
that would wait for the slots runs in a lane of its own instead, one at a time:
it never waits behind a big encode, and what it adds beside the slots is one
encode of a few milliseconds of CPU.

A request's encodes count as waiting from the moment it is admitted, while they still
wait for their output directories, until each starts: requests admitted side by side
cannot all pass a check made before any of them joined the queue. Of the places, one
caller (a uid other than root's and the worker's) may take its share
(``FRAMEWIRE_USER_SHARE``): no user can fill the queue and have every rank refused.

GPU bytes are counted per device: a full GPU holds back the encodes of its own
frames, not those of the host's other GPUs. An encode whose device holds
nothing of ours starts whatever the budget says (its temporaries are bounded
by the chunk budget), so a busy GPU slows encodes down but never stalls them.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from framewire.core.errors import Overloaded
from framewire.service._ops.shares import Share


@dataclass
class _Waiter:
    cpu: int
    gpu: int
    device: int
    granted: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Admission:
    """One request's admitted encodes, counted as waiting until each starts (or the
    request ends: :meth:`close`). Pass it to :meth:`Scheduler.hold`."""

    def __init__(self, scheduler: Scheduler, user: int | None, count: int, small: int):
        self._scheduler = scheduler
        self.user = user
        self._arriving = {False: count, True: small}  # admitted, not yet at ``hold``
        self._unstarted = count + small
        scheduler._pending[False] += count
        scheduler._pending[True] += small
        scheduler.share.add(user, count + small)

    def arrived(self, small: bool) -> None:
        """One encode reached the scheduler: from now on its line counts it."""
        if self._arriving[small]:
            self._arriving[small] -= 1
            self._scheduler._pending[small] -= 1

    def started(self) -> None:
        """One encode runs (or left): it no longer counts against its caller's share."""
        if self._unstarted:
            self._unstarted -= 1
            self._scheduler.share.add(self.user, -1)

    def close(self) -> None:
        """The request ended: whatever of it never started counts no more."""
        for small, left in self._arriving.items():
            self._scheduler._pending[small] -= left
            self._arriving[small] = 0
        self._scheduler.share.add(self.user, -self._unstarted)
        self._unstarted = 0


class Scheduler:
    def __init__(
        self,
        cpu_slots: int,
        max_queue: int,
        *,
        gpu_budget: Callable[[int], int] | None = None,
        user_limit: int | None = None,
    ):
        """``gpu_budget(device)`` returns the GPU bytes encodes may hold on that device
        now (a quarter of its free memory plus what encodes hold there: ``gpu_held``);
        None when there is no GPU. ``user_limit``: the encodes one (limited) caller may
        have waiting; None: no limit."""
        self.cpu_slots = cpu_slots
        self.max_queue = max_queue
        self.share = Share(user_limit, "FRAMEWIRE_MAX_QUEUE", "encodes waiting")
        self.gpu_budget = gpu_budget
        self.cpu_used = 0
        self.gpu_used: dict[int, int] = {}  # by device index
        self.running = 0
        self._queue: deque[_Waiter] = deque()
        self._small_busy = False
        self._small_queue: deque[asyncio.Future[None]] = deque()
        self._recent_s = 1.0  # moving average of encode time, for Retry-After
        self._pending = {False: 0, True: 0}  # admitted, not yet at ``hold``: by smallness

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def retry_after(self) -> float:
        """Seconds until the queue has likely drained by one place per slot group."""
        rounds = (len(self._queue) + 1) / max(1, self.running)
        return max(1.0, math.ceil(self._recent_s * rounds))

    def admit(self, count: int, small: int = 0, user: int | None = None) -> Admission:
        """Admit a request of ``count`` encodes (and ``small`` small ones) by caller ``user``
        (None: not limited), or refuse it if they would wait behind a full queue or past
        the caller's share of it. Close the admission when the request ends."""
        waiting = len(self._queue) + self._pending[False]
        waiting_small = len(self._small_queue) + self._pending[True]
        # Admitted encodes not yet at the scheduler are taken to need a slot each: they
        # make others wait only once the slots are spoken for.
        spoken_for = self.cpu_used + self._pending[False]
        would_wait = bool(self._queue) or spoken_for >= self.cpu_slots
        if would_wait and count and waiting + count > self.max_queue:
            raise Overloaded(
                f"{waiting} encodes already wait (limit {self.max_queue})",
                code="queue_full",
                retry_after=self.retry_after(),
            )
        if small and would_wait and waiting_small + small > self.max_queue:
            raise Overloaded(
                f"{waiting_small} small encodes already wait (limit {self.max_queue})",
                code="queue_full",
                retry_after=1.0,
            )
        if would_wait:  # admitted, not yet started: what the caller's share counts
            self.share.check(user, count + small, self.retry_after())
        return Admission(self, user, count, small)

    def gpu_held(self, device: int) -> int:
        """GPU bytes that running encodes hold on ``device``."""
        return self.gpu_used.get(device, 0)

    def _fits(self, cpu: int, gpu: int, device: int) -> bool:
        if self.cpu_used + cpu > self.cpu_slots and self.running > 0:
            return False
        held = self.gpu_held(device)
        if gpu and held and self.gpu_budget is not None:
            return held + gpu <= self.gpu_budget(device)
        return True

    def _grant_waiters(self) -> None:
        while self._queue:
            w = self._queue[0]
            if not w.granted.done() and not self._fits(w.cpu, w.gpu, w.device):
                return
            self._queue.popleft()
            if w.granted.done():  # cancelled while waiting
                continue
            self._take(w.cpu, w.gpu, w.device)
            w.granted.set_result(None)

    def _take(self, cpu: int, gpu: int, device: int) -> None:
        self.cpu_used += cpu
        if gpu:
            self.gpu_used[device] = self.gpu_held(device) + gpu
        self.running += 1

    def _give(self, cpu: int, gpu: int, device: int, seconds: float) -> None:
        self.cpu_used -= cpu
        if gpu:
            self.gpu_used[device] -= gpu
            if not self.gpu_used[device]:
                del self.gpu_used[device]
        self.running -= 1
        self._recent_s = 0.8 * self._recent_s + 0.2 * seconds
        self._grant_waiters()

    @contextlib.asynccontextmanager
    async def hold(
        self,
        cpu: int,
        gpu: int = 0,
        device: int = 0,
        *,
        small: bool = False,
        admission: Admission | None = None,
    ) -> AsyncIterator[float]:
        """Wait for ``cpu`` slots and ``gpu`` bytes on CUDA ``device``; yield the seconds
        waited; release on exit. A ``small`` encode that would wait takes the small lane.
        ``admission``: the request's, which stops counting the encode once it starts."""
        if admission is not None:
            admission.arrived(small)
        started = False
        try:
            cpu = max(1, min(cpu, self.cpu_slots))
            free = not self._queue and self._fits(cpu, gpu, device)
            lane = self._small_lane() if small and not free else self._slots(cpu, gpu, device)
            async with lane as waited:
                started = True
                if admission is not None:
                    admission.started()
                yield waited
        finally:
            if admission is not None and not started:
                admission.started()  # it left the line without starting

    @contextlib.asynccontextmanager
    async def _small_lane(self) -> AsyncIterator[float]:
        """The small lane: one encode at a time, the others in arrival order."""
        started = time.monotonic()
        if self._small_busy:
            turn = asyncio.get_running_loop().create_future()
            self._small_queue.append(turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():
                    self._small_next()  # handed the lane just as we were cancelled
                else:
                    with contextlib.suppress(ValueError):
                        self._small_queue.remove(turn)
                raise
        self._small_busy = True
        try:
            yield time.monotonic() - started
        finally:
            self._small_next()

    def _small_next(self) -> None:
        """The lane passes to the next small encode still waiting, else it is free."""
        while self._small_queue:
            turn = self._small_queue.popleft()
            if not turn.done():
                turn.set_result(None)  # the lane stays busy: handed over
                return
        self._small_busy = False

    @contextlib.asynccontextmanager
    async def _slots(self, cpu: int, gpu: int, device: int) -> AsyncIterator[float]:
        started = time.monotonic()
        if not self._queue and self._fits(cpu, gpu, device):
            self._take(cpu, gpu, device)
        else:
            waiter = _Waiter(cpu, gpu, device)
            self._queue.append(waiter)
            try:
                await waiter.granted
            except asyncio.CancelledError:
                if waiter.granted.done() and not waiter.granted.cancelled():
                    self._give(cpu, gpu, device, 0.0)  # granted just as we were cancelled
                else:
                    with contextlib.suppress(ValueError):
                        self._queue.remove(waiter)
                    self._grant_waiters()
                raise
        waited = time.monotonic() - started
        run_started = time.monotonic()
        try:
            yield waited
        finally:
            self._give(cpu, gpu, device, time.monotonic() - run_started)
