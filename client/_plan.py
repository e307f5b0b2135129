"""Each operation of a client or a stream writer written once, as a plan of steps.

A plan is a generator. It yields the steps that need I/O: a :class:`Call` to send
over HTTP, a blocking callable (a copy into shared memory, a wait on a CUDA
stream, a reconnect), or a chunk request on its way to be waited for; it is sent
back what the step gave. An ``Exception`` a step raises is thrown into the plan,
which decides what follows (a save no worker took is encoded here); anything else
(a cancellation, Ctrl-C) is not caught: the plan is closed, so its ``with`` and
``finally`` blocks run, and it goes on up. :func:`run` takes the steps here, in
turn (Client, VideoWriter); :func:`run_async` awaits the calls and runs the
blocking steps in a thread (AsyncClient, AsyncVideoWriter). Work in the plan
itself runs on the caller's thread, between steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, ParamSpec, TypeAlias, TypeVar

from framewire.client._calls import Call

T = TypeVar("T")
P = ParamSpec("P")
# A chunk request on its way: on the sync writer's sender thread, or the async one's task.
Pending: TypeAlias = "Future[T] | asyncio.Future[T]"


@dataclass(frozen=True)
class Blocking:
    work: Callable[[], Any]


@dataclass(frozen=True)
class Wait:
    pending: Pending[Any]


Step: TypeAlias = Call[Any] | Blocking | Wait
Plan: TypeAlias = Generator[Step, Any, T]
Later: TypeAlias = Callable[[], Plan[Any]] | None
# What takes a plan's calls: a client's ``_send`` (or, under it, its transport's request).
Send: TypeAlias = Callable[[Call[Any]], Any]
AsyncSend: TypeAlias = Callable[[Call[Any]], Awaitable[Any]]


def sent(call: Call[T]) -> Plan[T]:
    """The answer to ``call``."""
    answer: T = yield call
    return answer


def blocking(work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Plan[T]:
    """What ``work`` returns: a call that may block, kept off an event loop."""
    value: T = yield Blocking(functools.partial(work, *args, **kwargs))
    return value


def waited(pending: Pending[T]) -> Plan[T]:
    """The result of a request on its way, once it has one."""
    value: T = yield Wait(pending)
    return value


class _Walk(Generic[T]):
    """Where a plan stands: the step it asks for, or what it returned."""

    def __init__(self, plan: Plan[T]):
        self.plan = plan
        self.step: Step | None = None
        self.result: T  # once step is None
        self.resume(None, None)

    def resume(self, value: Any, error: Exception | None) -> None:
        try:
            self.step = self.plan.send(value) if error is None else self.plan.throw(error)
        except StopIteration as returned:
            self.step, self.result = None, returned.value


def _taken(step: Step, send: Send) -> tuple[Any, Exception | None]:
    try:
        if isinstance(step, Call):
            return send(step), None
        if isinstance(step, Wait):
            return step.pending.result(), None
        return step.work(), None
    except Exception as exc:  # the plan's to judge; a Ctrl-C goes on up
        return None, exc


async def _awaited(step: Step, send: AsyncSend) -> tuple[Any, Exception | None]:
    try:
        if isinstance(step, Call):
            return await send(step), None
        if isinstance(step, Wait):
            return await asyncio.wrap_future(step.pending), None
        return await asyncio.to_thread(step.work), None
    except Exception as exc:  # the plan's to judge; a cancellation goes on up
        return None, exc


def _through(plan: Plan[T], send: Send) -> T:
    with contextlib.closing(plan):
        walk = _Walk(plan)
        while walk.step is not None:
            walk.resume(*_taken(walk.step, send))
    return walk.result


async def _through_async(plan: Plan[T], send: AsyncSend) -> T:
    with contextlib.closing(plan):
        walk = _Walk(plan)
        while walk.step is not None:
            walk.resume(*await _awaited(walk.step, send))
    return walk.result


def run(plan: Plan[T], send: Send, *, failed: Later = None, last: Later = None) -> T:
    """``plan``'s result, its steps taken here; when it raises (a cancellation too), the
    plan ``failed()`` runs after it, and ``last()`` runs in any case."""
    try:
        return _through(plan, send)
    except BaseException:
        if failed is not None:
            _through(failed(), send)
        raise
    finally:
        if last is not None:
            _through(last(), send)


async def run_async(
    plan: Plan[T], send: AsyncSend, *, failed: Later = None, last: Later = None
) -> T:
    """:func:`run` with the calls awaited and the blocking steps in a thread."""
    try:
        return await _through_async(plan, send)
    except BaseException:
        if failed is not None:
            await _through_async(failed(), send)
        raise
    finally:
        if last is not None:
            await _through_async(last(), send)
