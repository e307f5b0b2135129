"""hls.js in headless Chromium, the player the live view's LL-HLS tests watch with, proved
on a VOD that ffmpeg segments: served cross-origin on loopback, it plays to its end and
shows the clip's colour."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.support.browser import browser_missing, chromium, fresh_page, shows
from tests.support.hls_check import check_media_playlist
from tests.support.hlsjs import (
    HLSJS_VERSION,
    hlsjs_missing,
    open_hls_player,
    player_pixel,
    player_state,
)
from tests.support.media import FFMPEG
from tests.support.real import unavailable

SECONDS = 2


@pytest.fixture(scope="module")
def player() -> Iterator[Any]:
    """Chromium, launched once for these tests (each gets a page of its own), and hls.js."""
    missing = browser_missing() or hlsjs_missing()
    if missing is not None:
        unavailable(f"no browser or hls.js can be installed here: {missing}")
    with chromium() as launched:
        yield launched


class _CorsHandler(SimpleHTTPRequestHandler):
    """Files of a directory, readable from any origin (as the live view's will be)."""

    def end_headers(self) -> None:
        self.send_header("Access-Control-Allow-Origin", "*")
        super().end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def vod(tmp_path: Path) -> Iterator[str]:
    """The URL of a 2 s red fMP4 HLS VOD (two 1 s segments), served on loopback."""
    subprocess.run(
        [FFMPEG, "-v", "error", "-f", "lavfi", "-i", f"color=c=red:s=64x64:r=24:d={SECONDS}",
         "-c:v", "libx264", "-pix_fmt", "yuv420p", "-g", "24", "-f", "hls", "-hls_time", "1",
         "-hls_segment_type", "fmp4", "-hls_playlist_type", "vod",
         "-hls_flags", "independent_segments", str(tmp_path / "out.m3u8")],
        check=True, timeout=60,
    )  # fmt: skip
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_CorsHandler, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/out.m3u8"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_ffmpegs_playlist_passes_the_checker(vod: str, tmp_path: Path) -> None:
    p = check_media_playlist((tmp_path / "out.m3u8").read_text())
    assert p.ended and p.map_uri == "init.mp4" and len(p.segments) == SECONDS


@pytest.mark.registry  # hls.js comes from the npm registry
def test_hlsjs_plays_a_vod_to_its_end(player: Any, vod: str) -> None:
    with fresh_page(player) as page:
        open_hls_player(page, vod)
        page.wait_for_function(
            "() => window.hlsPlayer.ended || window.hlsPlayer.errors.length > 0", timeout=15_000
        )
        state = player_state(page)
        assert state["errors"] == [], state
        assert state["supported"] and state["version"] == HLSJS_VERSION, state
        assert state["ended"] and state["currentTime"] >= SECONDS - 0.1, state
        assert state["buffered"] and state["buffered"][-1][0] >= SECONDS - 0.1, state
        details = state["levelDetails"]
        assert details["live"] is False and details["endSN"] == SECONDS - 1, details
        # The last frame stays on screen after the end.
        pixel = player_pixel(page, 32, 32) or (0, 0, 0)
        assert shows(pixel, (255, 0, 0)), pixel
        print(f"hls.js {state['version']}; canPlayType(HLS): {state['canPlayNative']!r}")


@pytest.mark.registry
def test_the_player_records_samples_while_playing(player: Any, vod: str) -> None:
    """currentTime moves and the buffered samples are stamped in time order."""
    with fresh_page(player) as page:
        open_hls_player(page, vod, low_latency=False)
        page.wait_for_function("() => window.hlsPlayer.currentTime > 0.5", timeout=15_000)
        state = player_state(page)
        assert state["playing"] and state["errors"] == [], state
        ends = [end for end, _ in state["buffered"]]
        stamps = [stamp for _, stamp in state["buffered"]]
        assert ends == sorted(set(ends)) and stamps == sorted(stamps), state
