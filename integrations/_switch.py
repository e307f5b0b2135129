"""Whether an integration acts, and what it says of each save: where saves went, one log
line per cause, and nothing of a worker's words in the engine's log but plain text.

Everything comes from the environment: the engine's process is not ours to configure.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import Counter

ENV = "FRAMEWIRE_INTEGRATIONS"
log = logging.getLogger("framewire.integrations")

_counts: Counter[str] = Counter()
_said: set[str] = set()
_lock = threading.Lock()
_CODE = re.compile(r"[a-z][a-z0-9_]{0,47}")
_CLEAN_CHARS = 240  # of a worker's message, in a log line or an error raised into the engine


def enabled(name: str) -> bool:
    """Whether ``FRAMEWIRE_INTEGRATIONS`` (comma-separated, or ``all``) names ``name``."""
    asked = {n.strip().lower() for n in os.environ.get(ENV, "").split(",") if n.strip()}
    return name in asked or "all" in asked


def counts() -> dict[str, int]:
    """Saves of this process by where they went: ``<engine>:routed`` through the worker,
    ``<engine>:engine:<why>`` to the engine's own function."""
    with _lock:
        return dict(_counts)


def count(key: str) -> None:
    with _lock:
        _counts[key] += 1


def say_once(key: str, message: str, *args: object, level: int = logging.INFO) -> None:
    """Log ``message`` the first time ``key`` is seen in this process."""
    with _lock:
        if key in _said:
            return
        _said.add(key)
    log.log(level, message, *args)


def clean(text: object) -> str:
    """``text`` as one line of plain text for the engine's log: control and separator
    characters escaped (a worker's newline cannot forge a line), the worker's token
    hidden, at most _CLEAN_CHARS characters."""
    out = str(text)
    token = os.environ.get("FRAMEWIRE_TOKEN")
    if token:
        out = out.replace(token, "[token]")
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in out)
    return out if len(out) <= _CLEAN_CHARS else out[: _CLEAN_CHARS - 3] + "..."


def clean_code(code: object) -> str:
    """A worker's error code as a key of :func:`counts`: one of the worker's stable codes
    (lower case, digits, underscores), else a fixed word, so a worker cannot make a line or
    an unbounded number of keys of it."""
    return code if isinstance(code, str) and _CODE.fullmatch(code) else "an unknown code"


class Declined(Exception):
    """This save is not one framewire reproduces: the engine's own function runs."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why
