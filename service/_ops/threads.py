"""Blocking work on a thread pool, stopped through an event when its task is cancelled."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

T = TypeVar("T")


async def in_thread(
    pool: Executor, cancel: threading.Event, fn: Callable[..., T], *args: object
) -> T:
    """Run ``fn(*args)`` on ``pool``. If this task is cancelled, ``cancel`` is set and
    the call awaited: what it reads must stay open until the thread lets go of it. A
    call that completed anyway is reported as done."""
    # The thread sees this task's context (the request id its log lines carry).
    context = contextvars.copy_context()
    future = asyncio.get_running_loop().run_in_executor(
        pool, functools.partial(context.run, fn, *args)
    )
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        cancel.set()
        await asyncio.wait([future])
        if future.cancelled() or future.exception() is not None:
            raise
        return future.result()
