"""What the benchmark scripts share: their options, the JSON rows, how they exit."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import NoReturn


def count(text: str) -> int:
    """An argparse type: a whole number, at least 1 (medians of nothing are undefined)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is less than 1")
    return value


def size(text: str) -> tuple[int, int]:
    """An argparse type: ``WxH``, each a whole number of at least 1 (-> (width, height))."""
    w, _, h = text.partition("x")
    try:
        return count(w), count(h)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not WIDTHxHEIGHT") from None


def parser(
    doc: str, *, frames: int | list[int], width: int, height: int, repeat: int
) -> argparse.ArgumentParser:
    """The options every clip benchmark takes, ``doc`` as its help as written: the clip's
    size and length (several lengths where ``frames`` is a list), the runs of each, and
    where the JSON rows go."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    several = "+" if isinstance(frames, list) else None
    p.add_argument("--frames", type=count, nargs=several, default=frames)
    p.add_argument("--width", type=count, default=width)
    p.add_argument("--height", type=count, default=height)
    p.add_argument("--repeat", type=count, default=repeat)
    p.add_argument("--json", type=Path, default=None)
    return p


def rank_context(*preload: str) -> BaseContext:
    """Where a benchmark's rank-like processes come from: forks of one server process
    that has imported this script and ``preload`` (torch, the client) once. Each is a
    process of its own, as torchrun's ranks are, without paying those imports again
    (about 2.5 s of CPU apiece on 2 cores, before anything is timed)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", *preload])
    return ctx


def timed_ms(fn: Callable[[int], object], repeat: int) -> list[float]:
    """Milliseconds of each of ``repeat`` calls ``fn(0)``, ``fn(1)``, …"""
    times = []
    for i in range(repeat):
        started = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - started) * 1e3)
    return times


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values``, nearest rank (no interpolation between runs)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def write_json(path: Path | None, rows: object) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rows, indent=2) + "\n")


def run(main: Callable[[], int]) -> NoReturn:
    """Exit with ``main()``'s status; SIGTERM and Ctrl-C unwind, so the scratch files go."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        status = main()
    except KeyboardInterrupt:
        status = 130
    sys.exit(status)
