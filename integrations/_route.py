"""A save through the worker, or the engine's own function: never an error of framewire's.

Whatever fails on framewire's side (a save it does not reproduce, no worker, a worker
that refuses, stalls or reports a file that is not there, framewire's own bug) runs the
engine's original function with the caller's arguments, and the log says why, once per
cause. What the engine's own function raises goes to the caller unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from framewire.client import FramewireError
from framewire.integrations._switch import Declined, clean, clean_code, count, log, say_once
from framewire.integrations._worker import WORKER, Mismatch, Silent, timed_out, timeout_s

T = TypeVar("T")
# The client's code for a memory output's bytes that do not hash as the worker said
# (docs/api.md): they did not check out, as a Mismatch here.
TAKEN_OTHER_BYTES = "output_mismatch"


def why_not(exc: Exception) -> tuple[str, int, str]:
    """Why a routed save did not happen: the cause (a key of :func:`counts`, one line per
    cause), its log level, and what the log says of it (cleaned of the worker's words)."""
    if isinstance(exc, Declined):
        return exc.why, logging.INFO, exc.why
    if isinstance(exc, Silent):
        return "the worker did not answer a moment ago", logging.WARNING, clean(exc)
    if timed_out(exc):
        WORKER.went_silent()
        why = f"the worker did not answer within {timeout_s():g} s"
        return why, logging.WARNING, f"{why} (FRAMEWIRE_INTEGRATION_TIMEOUT_S)"
    if isinstance(exc, Mismatch) or getattr(exc, "code", None) == TAKEN_OTHER_BYTES:
        return "the worker's output did not check out", logging.WARNING, clean(exc)
    if isinstance(exc, FramewireError):  # no worker, another encoder, a refusal
        why = f"the worker answered {clean_code(exc.code)}"
        return why, logging.WARNING, f"{why} ({clean(exc.message)})"
    why = f"framewire failed ({type(exc).__name__})"  # framewire's own failure
    return why, logging.WARNING, f"{why}: {clean(exc)}"


def left(engine: str, exc: Exception) -> None:
    """Count and say (once per cause) that a save of ``engine``'s runs its own code."""
    why, level, said = why_not(exc)
    count(f"{engine}:engine:{why}")
    message = "framewire: a %s save runs the engine's own code: %s"
    say_once(f"{engine}:{why}", message, engine, said, level=level)
    if level > logging.INFO:
        log.debug("framewire: the routed %s save failed", engine, exc_info=exc)


def failed(engine: str, exc: Exception) -> RuntimeError:
    """A save the worker had begun and that cannot go back to the engine (its frames went
    back to their producer chunk by chunk): counted, said once per cause, and returned as
    the error the engine's own encoder would raise, its message cleaned."""
    why, _, said = why_not(exc)
    count(f"{engine}:failed:{why}")
    message = "framewire: a %s encode the worker had begun failed: %s"
    say_once(f"{engine}:failed:{why}", message, engine, said, level=logging.WARNING)
    log.debug("framewire: the routed %s encode failed", engine, exc_info=exc)
    return RuntimeError(f"framewire: the encode failed: {said}")


def route(
    engine: str,
    routed: Callable[[], T],
    original: Callable[..., T],
    args: Sequence[Any],
    kwargs: dict[str, Any],
) -> T:
    """``routed()`` through the worker; when it does not happen, the engine's
    ``original(*args, **kwargs)`` (its bytes, its errors)."""
    try:
        result = routed()
    except Exception as exc:  # a cancellation or an interrupt goes on up
        left(engine, exc)
    else:
        count(f"{engine}:routed")
        return result
    return original(*args, **kwargs)


def guarded(what: str, action: Callable[[], None]) -> None:
    """Run framewire's ``action`` in the engine's process (a plugin's registration, a
    check): whatever fails is logged, never raised into the engine."""
    try:
        action()
    except Exception as exc:
        message = "framewire: %s failed (%s: %s): the engine's own code runs"
        kind, said = type(exc).__name__, clean(exc)
        say_once(f"guard:{what}", message, what, kind, said, level=logging.WARNING)
        log.debug("framewire: %s failed", what, exc_info=exc)
