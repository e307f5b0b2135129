"""The benchmarks' figures: PNGs beside their tables, drawn with matplotlib (no display).

Each script builds its figures from the rows it printed, through these few helpers:
one look for every figure, legends that name the goals drawn, a footnote naming
the host and the command that made it (so a figure says what it shows), and the
``--figures DIR`` option.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path(__file__).resolve().parent / "figures"
COLORS = {"framewire": "#1f77b4", "imageio": "#d62728", "bare ffmpeg": "#7f7f7f"}
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#7f7f7f")


def add_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--figures",
        type=Path,
        default=DEFAULT_DIR,
        metavar="DIR",
        help="where to write the PNG figures (default: benchmarks/figures)",
    )


# How busy the host was as the run began (the scripts import this module first): wall
# times on a host shared with other work are longer than on an idle one.
LOAD_AT_START = os.getloadavg()[0]
WHERE_OUTPUT_GOES = ("--json", "--figures")  # options that change nothing measured


def command() -> str:
    """The command line that made the figure, as one would type it from the repository
    (without the options that only say where to write)."""
    args, shown = sys.argv[1:], []
    while args:
        arg = args.pop(0)
        if arg in WHERE_OUTPUT_GOES:
            args = args[1:]
        elif not arg.startswith(tuple(f"{o}=" for o in WHERE_OUTPUT_GOES)):
            shown.append(arg)
    return shlex.join([f"benchmarks/{Path(sys.argv[0]).name}", *shown])


def host() -> str:
    cpus = len(os.sched_getaffinity(0))
    return f"{cpus} CPUs, load average {LOAD_AT_START:.1f} as the run began"


def value(v: float) -> str:
    """A bar's or a point's label: three significant digits, no exponent."""
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def color(name: str, i: int) -> str:
    return COLORS.get(name, PALETTE[i % len(PALETTE)])


@contextlib.contextmanager
def figure(path: Path, title: str, panels: int = 1, note: str = "") -> Iterator[list[Any]]:
    """Axes for ``panels`` side-by-side plots, saved to ``path`` as a PNG on leaving."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(5.6 * panels, 4.4), squeeze=False)
    try:
        yield list(axes[0])
        for ax in axes[0]:
            if ax.get_legend_handles_labels()[1]:
                ax.legend(fontsize=8, loc="best")
        fig.suptitle(title, fontsize=12)
        said = [note] if note else []
        footer = [line for text in [*said, f"{host()}; {command()}"]
                  for line in textwrap.wrap(text, 60 * panels + 40)]  # fmt: skip
        fig.text(0.01, 0.01, "\n".join(footer), fontsize=7, color="#555555", va="bottom")
        fig.tight_layout(rect=(0, 0.035 * len(footer) + 0.01, 1, 0.97))
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    print(f"figure: {path}", file=sys.stderr)


def lines(
    ax: Any,
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    *,
    xlabel: str,
    ylabel: str,
    log_x: bool = False,
    log_y: bool = False,
) -> None:
    """One line with markers per series (x, y), labelled at its last point too. A log
    scale is used only where every value can go on it (a tiny clip's 0 MiB cannot)."""
    for i, (name, (x, y)) in enumerate(series.items()):
        ax.plot(x, y, marker="o", label=name, color=color(name, i))
        if len(y):
            ax.annotate(value(y[-1]), (x[-1], y[-1]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8, color=color(name, i))  # fmt: skip
    ax.margins(x=0.1)  # room for the last point's label
    xs = sorted({v for x, _ in series.values() for v in x})
    if log_x and len(xs) > 1 and xs[0] > 0:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{v:g}" for v in xs])
    if log_y and all(v > 0 for _, y in series.values() for v in y):
        _log_y(ax)
    _finish(ax, xlabel, ylabel)


def bars(
    ax: Any,
    groups: Sequence[str],
    series: dict[str, Sequence[float]],
    *,
    ylabel: str,
    xlabel: str = "",
    log_y: bool = False,
) -> None:
    """Bars of each series side by side within each group, each labelled with its value."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        offsets = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        label = name if len(series) > 1 else "_nolegend_"  # one series: the y label says it
        drawn = ax.bar(offsets, values, width, label=label, color=color(name, i))
        ax.bar_label(drawn, labels=[value(v) for v in values], fontsize=7, padding=2)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    if log_y and all(v > 0 for values in series.values() for v in values):
        _log_y(ax)
    else:
        # Room above the tallest bar for its label and the legend (series and a goal).
        ax.margins(y=0.15 + 0.12 * (len(series) + 1))
    _finish(ax, xlabel, ylabel)


def pivot_bars(
    ax: Any,
    rows: Sequence[dict[str, Any]],
    group: str,
    series: str,
    key: str,
    *,
    ylabel: str,
    xlabel: str = "",
    log_y: bool = False,
) -> None:
    """:func:`bars` of a table's rows: a group per value of ``rows[i][group]``, a series per
    value of ``rows[i][series]`` (both in order of first appearance), heights ``rows[i][key]``."""
    groups = list(dict.fromkeys(r[group] for r in rows))
    names = list(dict.fromkeys(r[series] for r in rows))
    cell = {(r[group], r[series]): r[key] for r in rows}
    table = {name: [cell[(g, name)] for g in groups] for name in names}
    bars(ax, [str(g) for g in groups], table, ylabel=ylabel, xlabel=xlabel, log_y=log_y)


def reference(ax: Any, value: float, label: str) -> None:
    """A dashed horizontal line, named in the legend: a goal or a yardstick."""
    ax.axhline(value, linestyle="--", linewidth=1, color="#555555", label=label)


def _log_y(ax: Any) -> None:
    from matplotlib.ticker import FuncFormatter

    def plain(v: float, _: object) -> str:  # 200, not 2 x 10^2; only 1, 2 and 5 of a decade
        return f"{v:g}" if f"{v:e}"[0] in "125" else ""

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(plain))
    ax.yaxis.set_minor_formatter(FuncFormatter(plain))


def _finish(ax: Any, xlabel: str, ylabel: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
