"""The stream and live-view benchmarks run on clips small enough for CI.

See tests/support/benchruns.py for what is asserted and what is not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.benchruns import assert_figures, bench


def test_stream_benchmark(tmp_path: Path) -> None:
    out, figures = tmp_path / "stream.json", tmp_path / "figures"
    r = bench("stream.py", "--frames", "8", "--chunk", "3", "--width", "64", "--height", "48",
              "--repeat", "1", "--json", str(out), "--figures", str(figures))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert_figures(figures, "stream-tail.png")
    rows = json.loads(out.read_text())["runs"]
    modes = sorted(row["mode"] for row in rows if row["rate"] > 0)
    assert modes == ["a", "a", "b", "b", "c", "c"]  # two rates, one run each
    assert len({row["sha256"] for row in rows}) == 1
    assert "same bytes (a), (b) and (c), every run: True" in r.stdout
    # The stream's extra memory is its two staging segments of 3 frames (a few KiB).
    assert all(row["extra_mib"] < 8 for row in rows if row["mode"] == "b"), rows


def test_live_benchmark(tmp_path: Path) -> None:
    from tests.support.browser import browser_missing

    missing = browser_missing()
    if missing is not None:
        pytest.skip(f"no browser can be installed here: {missing}")
    out = tmp_path / "live.json"
    r = bench("live.py", "--frames", "32", "--width", "64", "--height", "48",
              "--viewers", "0", "2", "--json", str(out))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads(out.read_text())
    assert [row["viewers"] for row in results["rows"]] == [0, 2]
    assert len({row["sha256"] for row in results["rows"]}) == 1
    watched = results["rows"][1]
    assert len(watched["delays_ms"]) == 3 and all(d > 0 for d in watched["delays_ms"])
    assert len(watched["http_viewer_bytes"]) == 1 and watched["http_viewer_bytes"][0] > 0
