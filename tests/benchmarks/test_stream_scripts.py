"""The stream and live-view benchmarks run on clips small enough for CI.

See tests/support/benchruns.py for what is asserted and what is not."""

from __future__ import annotations

from pathlib import Path

from tests.support.benchruns import bench_json
from tests.support.real import unavailable


def test_stream_benchmark(tmp_path: Path) -> None:
    r, results = bench_json(tmp_path, "stream.py", "--frames", "8", "--chunk", "3", "--width", "64",
                            "--height", "48", "--repeat", "1",
                            figures=("stream-tail.png",))  # fmt: skip
    rows = results["runs"]
    modes = sorted(row["mode"] for row in rows if row["rate"] > 0)
    assert modes == ["a", "a", "b", "b", "b0", "b0", "c", "c"]  # two rates, one run each
    assert len({row["sha256"] for row in rows}) == 1
    assert "same bytes (a), (b) and (c), every run: True" in r.stdout
    # The stream's extra memory is its two staging segments of 3 frames (a few KiB).
    assert all(row["extra_mib"] < 8 for row in rows if row["mode"] in ("b", "b0")), rows
    assert "producer held in write, all rates:" in r.stdout


def test_live_benchmark(tmp_path: Path) -> None:
    from tests.support.browser import browser_missing
    from tests.support.hlsjs import hlsjs_missing

    missing = browser_missing() or hlsjs_missing()
    if missing is not None:
        unavailable(f"no browser or no hls.js can be installed here: {missing}")
    r, results = bench_json(tmp_path, "live.py", "--frames", "40", "--sizes", "64x48",
                            "--wall-size", "64x48", "--wall-frames", "40", "--wall-runs", "1",
                            "--wall-viewers", "2")  # fmt: skip
    assert [row["player"] for row in results["rows"]] == ["floor", "mse", "hls", "hls-1.5x"]
    assert results["sha256_equal"]
    for row in results["rows"]:
        playable = row["delays_ms"]["playable"]
        # hls.js counts only the chunks from the part it joined at: one at least.
        if row["player"].startswith("hls"):
            assert len(playable) >= 1, row
        else:
            assert len(playable) == 4, row
        assert all(d > 0 for d in playable), row
    assert [w["viewers"] for w in results["walls"]] == [0, 2]
    assert all(n > 0 for n in results["walls"][1]["followed_bytes"])
    assert "HLS shown p50 - x264 p50" in r.stdout and "ratio" in r.stdout
