"""Noticing an HTTP caller that went away while its request still runs."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

POLL_S = 0.1  # how often the connection is asked; a gone caller costs at most this


async def watch_caller(
    is_disconnected: Callable[[], Awaitable[bool]],
    stopped: threading.Event,
    gone: Callable[[], None],
) -> None:
    """Call ``gone()`` once the caller has disconnected; give up once ``stopped`` is set
    (the work ended on its own, or was stopped). Run it as a task, cancelled at the
    request's end."""
    while not stopped.is_set():
        if await is_disconnected():
            gone()
            return
        await asyncio.sleep(POLL_S)
