"""The watch page in a real browser: headless Chromium plays a session while a producer
streams it, shows the clip's colours, and ends when the session finishes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from framewire.client import Client, VideoWriter

from tests.support.browser import browser_missing, chromium, fresh_page, shows
from tests.support.hlsjs import hlsjs_missing, open_hls_player, player_frame, player_state
from tests.support.real import unavailable

FPS = 24
CHUNK = 8
# Solid colours, 32 frames each: what the page shows says which part of the clip it is.
COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
SEGMENT = 32

READ_COLOUR = """(seekTo) => new Promise((resolve) => {
  const v = document.getElementById("video");
  const read = () => {
    const c = document.createElement("canvas");
    c.width = v.videoWidth; c.height = v.videoHeight;
    const g = c.getContext("2d");
    g.drawImage(v, 0, 0);
    const d = g.getImageData(c.width >> 1, c.height >> 1, 1, 1).data;
    const r = v.buffered;
    resolve({colour: [d[0], d[1], d[2]], time: v.currentTime,
             start: r.length ? r.start(0) : 0, readyState: v.readyState});
  };
  if (seekTo === null) { read(); return; }
  // "seeked" can come before the sought frame is on screen (a loaded machine): read once
  // the frame is presented, or after a second at the latest.
  let done = false;
  const once = () => { if (!done) { done = true; read(); } };
  v.addEventListener("seeked", () => {
    if (v.requestVideoFrameCallback) v.requestVideoFrameCallback(once);
    setTimeout(once, 1000);
  }, {once: true});
  setTimeout(once, 10000);  // no seek at all: read what there is, the caller judges it
  v.currentTime = seekTo;
})"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Chromium, launched once for these tests (each gets a page of its own)."""
    missing = browser_missing()
    if missing is not None:
        unavailable(f"no browser can be installed here: {missing}")
    with chromium() as launched:
        yield launched


def _clip(rounds: int = 1) -> torch.Tensor:
    frames = SEGMENT * len(COLOURS) * rounds
    clip = torch.empty(3, frames, 96, 128)
    for i in range(len(COLOURS) * rounds):
        colour = torch.tensor(COLOURS[i % len(COLOURS)]).view(3, 1, 1, 1) / 255
        clip[:, i * SEGMENT : (i + 1) * SEGMENT] = colour
    return clip


class _Producer(threading.Thread):
    """Writes the rest of a clip, past the first chunk already written, at the clip's own
    frame rate, chunk by chunk, then closes the writer; aborts it on an error."""

    def __init__(self, writer: VideoWriter, clip: torch.Tensor) -> None:
        super().__init__()
        self.writer, self.clip = writer, clip
        self.errors: list[BaseException] = []
        self.written = threading.Event()  # every frame written; the close still to come
        self.start()

    def run(self) -> None:
        try:
            for t0 in range(CHUNK, self.clip.shape[1], CHUNK):
                time.sleep(CHUNK / FPS)
                self.writer.write(self.clip[:, t0 : t0 + CHUNK])
            self.written.set()
            self.writer.close()
        except BaseException as exc:
            self.errors.append(exc)
            self.writer.abort()


def _expected(sample: dict[str, Any], frames: int) -> tuple[int, int, int] | None:
    """The colour of the frame at the sample's time; None near a change of colour."""
    frame = min(round((sample["time"] - sample["start"]) * FPS), frames - 1)
    if frame % SEGMENT < 3 or frame % SEGMENT > SEGMENT - 3:
        return None
    return COLOURS[frame // SEGMENT % len(COLOURS)]


@pytest.mark.parametrize("player", ["mse", "hls"])
def test_the_watch_page_plays_the_stream_and_ends(worker, browser, player):
    """Its default player here (MSE: Chromium has MediaSource), and the browser's own
    HLS player that the page picks where MSE is missing (``player=hls`` asks for it:
    Chromium plays HLS natively too)."""
    clip = _clip()
    frames = clip.shape[1]
    with Client(worker.uds_url) as client, fresh_page(browser) as page:
        writer = client.open_video(f"watched-{player}.mp4", fps=FPS, live=True)
        writer.write(clip[:, :CHUNK])
        assert writer.watch_url is not None and writer.hls_url is not None
        if player == "mse":
            page.goto(writer.watch_url)
        assert page.evaluate("MediaSource.isTypeSupported('video/mp4; codecs=\"avc1.64001f\"')")
        producer = _Producer(writer, clip)
        if player == "hls":
            page.goto(writer.watch_url + "&player=hls")
        samples = []
        deadline = time.monotonic() + 180  # real-time playback, on a loaded machine at worst
        while page.evaluate("window.framewireLive && window.framewireLive.state") != "ended":
            state = page.evaluate("window.framewireLive")
            assert time.monotonic() < deadline and state["state"] != "error", state
            sample = page.evaluate(READ_COLOUR, None)
            if sample["readyState"] >= 2 and sample["time"] > 0:
                samples.append(sample)
            time.sleep(0.1)
        producer.join(30)
        assert not producer.errors and writer.result is not None and writer.result.ok
        live = page.evaluate("window.framewireLive")
        assert live["reason"] == "finished" and live["player"] == player
        if player == "mse":
            assert live["frames"] == frames
        assert page.evaluate("document.getElementById('video').ended")
        assert page.text_content("#state") == "ended (finished)"
        # It played: time went forward with enough data to go on (HAVE_FUTURE_DATA).
        times = [s["time"] for s in samples]
        # (Chromium's own HLS player starts near the live edge, some three segments in.)
        span = 2 if player == "mse" else 0.5
        assert times == sorted(times) and times[-1] - times[0] > span
        assert any(s["readyState"] >= 3 for s in samples)
        # And it showed the clip: each colour where the clip has it, while playing ...
        if player == "hls":  # its buffer starts where it joined; the timeline starts at 0
            samples = [s | {"start": 0.0} for s in samples]
        judged = [(s, _expected(s, frames)) for s in samples]
        judged = [(s, want) for s, want in judged if want is not None]
        shown = {want for _, want in judged}
        assert shown == set(COLOURS) if player == "mse" else shown
        wrong = [
            (s["time"], s["colour"], want) for s, want in judged if not shows(s["colour"], want)
        ]
        assert not wrong
        # ... and every segment again when sought to (MSE: Chromium's own HLS player keeps
        # no more than it played of a live playlist).
        start = samples[0]["start"]
        for i, colour in enumerate(COLOURS if player == "mse" else []):
            at = start + (i * SEGMENT + SEGMENT / 2) / FPS
            seen = page.evaluate(READ_COLOUR, at)
            if not shows(seen["colour"], colour):  # drawn before the frame was: once more
                time.sleep(1)
                seen = page.evaluate(READ_COLOUR, None)
            assert shows(seen["colour"], colour), (i, seen)


def test_hlsjs_plays_the_hls_url_while_chunks_arrive(worker, browser):
    """hls.js from the npm registry, on a page of another origin, plays ``hls_url`` in
    low-latency mode while the producer still writes: time advances, the frames shown
    have the clip's colours where the clip has them, and it reaches the end."""
    missing = hlsjs_missing()
    if missing is not None:
        unavailable(f"hls.js cannot be installed here: {missing}")
    clip = _clip(rounds=2)
    frames = clip.shape[1]
    with Client(worker.uds_url) as client, fresh_page(browser) as page:
        writer = client.open_video("hlsjs.mp4", fps=FPS, live=True)
        writer.write(clip[:, :CHUNK])
        assert writer.hls_url is not None
        producer = _Producer(writer, clip)
        open_hls_player(page, writer.hls_url)
        samples, while_written = [], []
        deadline = time.monotonic() + 120
        while not (state := player_state(page))["ended"]:
            assert time.monotonic() < deadline and not state["errors"], state
            shown = player_frame(page, 64, 48)
            if shown is not None and shown[0] > 0:
                sample = {"time": shown[0], "start": 0.0, "colour": shown[1]}
                samples.append(sample)
                if not producer.written.is_set():
                    while_written.append(sample)
            time.sleep(0.1)
        producer.join(30)
    assert not producer.errors and writer.result is not None and writer.result.ok
    assert state["levelDetails"]["canBlockReload"] and state["levelDetails"]["partList"]
    assert not state["levelDetails"]["live"]  # the final playlist: EXT-X-ENDLIST
    assert len(while_written) > 5, "it played nothing before the producer was done"
    times = [s["time"] for s in samples]
    assert times == sorted(times) and times[-1] - times[0] > 2
    assert times[-1] >= (frames - CHUNK) / FPS  # to the end
    judged = [(s, _expected(s, frames)) for s in samples]
    judged = [(s, want) for s, want in judged if want is not None]
    assert len({want for _, want in judged}) >= 2
    wrong = [(s["time"], s["colour"], w) for s, w in judged if not shows(s["colour"], w)]
    assert not wrong
