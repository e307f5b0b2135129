"""What ``framewire encode`` and ``framewire decode`` print: progress while they work, then
one summary line (or one JSON object).

The progress is drawn in place with rich, and only when stdout is a terminal
and neither ``--quiet`` nor ``--json`` was given: piped output holds nothing
but the result, without a control character. The count is polled, never
guessed: each command hands the meter a function returning how far the work
really is (the worker's chunk answers, the frames fed to ffmpeg, the size of
the memfd a decode writes into).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

REFRESH_S = 0.1  # how often the count is read and the line redrawn


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress, only the summary line"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the result as one JSON object (no progress)"
    )


@dataclass(frozen=True)
class Output:
    """How a command reports: a live meter or not, a summary line or a JSON object."""

    quiet: bool = False
    json: bool = False

    @classmethod
    def of(cls, args: argparse.Namespace) -> Output:
        return cls(quiet=args.quiet, json=args.json)

    @property
    def live(self) -> bool:
        return not (self.quiet or self.json) and sys.stdout.isatty()

    def result(self, summary: str, fields: dict[str, Any]) -> None:
        print(json.dumps(fields, default=str) if self.json else summary, flush=True)


class Count:
    """The latest count one thread reports (``set``) and the meter's thread reads."""

    def __init__(self) -> None:
        self.value = 0

    def set(self, value: int) -> None:
        self.value = value  # one int: nothing to lock

    def get(self) -> int:
        return self.value


def rate(frames: int, seconds: float) -> str:
    return f"{frames / seconds:.1f} fps" if seconds > 0 else "- fps"


class Meter:
    """Frames done of ``total``, with frames per second, elapsed and remaining time,
    redrawn in place while the block runs (when ``live``), then erased.

    ``done`` is read every REFRESH_S on the meter's own thread; None: the work
    reports no count (only elapsed time is shown). ``total`` None: not known.
    Not live, it only times the block (``elapsed_s``).
    """

    def __init__(
        self,
        label: str,
        total: int | None,
        done: Callable[[], int] | None,
        *,
        live: bool,
    ):
        self.label = label
        self.total = total
        self.done = done
        self.live = live
        self.elapsed_s = 0.0
        self._started = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> Meter:
        self._started = time.monotonic()
        if self.live:
            self._progress = _progress(counted=self.done is not None)
            self._task = self._progress.add_task(self.label, total=self.total)
            self._progress.start()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._progress is not None:
            self._redraw()
            self._progress.stop()  # transient: the summary takes its place
        self.elapsed_s = time.monotonic() - self._started

    def _poll(self) -> None:
        while not self._stop.wait(REFRESH_S):
            self._redraw()

    def _redraw(self) -> None:
        assert self._progress is not None and self._task is not None
        if self.done is not None:
            done = self.done()
            finishing = self.total is not None and done >= self.total
            label = f"{self.label} (finishing)" if finishing else self.label
            self._progress.update(self._task, completed=done, description=label)
        self._progress.refresh()


def _progress(*, counted: bool) -> Progress:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        SpinnerColumn,
        Task,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class FramesPerSecond(ProgressColumn):
        def render(self, task: Task) -> Text:
            speed = task.speed  # rich's estimate over the recent updates
            return Text("  - fps" if speed is None else f"{speed:5.1f} fps", style="cyan")

    # The caller saw a terminal on stdout: draw there whatever the environment claims.
    console = Console(file=sys.stdout, force_terminal=True)
    if not counted:
        columns: list[ProgressColumn] = [
            SpinnerColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            TextColumn("elapsed"),
        ]
        return Progress(*columns, console=console, auto_refresh=False, transient=True)
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("frames"),
        FramesPerSecond(),
        TimeElapsedColumn(),
        TextColumn("elapsed"),
        TimeRemainingColumn(),
        TextColumn("left"),
        console=console,
        auto_refresh=False,
        transient=True,
    )
