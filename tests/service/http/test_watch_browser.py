"""The watch page in a real browser: headless Chromium plays a session while a producer
streams it, shows the clip's colours, and ends when the session finishes."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from framewire.client import Client

from tests.support.browser import browser_missing, chromium_page

FPS = 24
CHUNK = 8
# Solid colours, 32 frames each: what the page shows says which part of the clip it is.
COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
SEGMENT = 32
TOLERANCE = 48  # yuv420p and limited range move a solid colour by a few levels

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
  v.currentTime = seekTo;
})"""


@pytest.fixture(scope="module")
def browser() -> None:
    missing = browser_missing()
    if missing is not None:
        pytest.skip(f"no browser can be installed here: {missing}")


def _clip() -> torch.Tensor:
    frames = SEGMENT * len(COLOURS)
    clip = torch.empty(3, frames, 96, 128)
    for i, colour in enumerate(COLOURS):
        clip[:, i * SEGMENT : (i + 1) * SEGMENT] = torch.tensor(colour).view(3, 1, 1, 1) / 255
    return clip


def _close(a: list[int], b: tuple[int, int, int]) -> bool:
    return all(abs(x - y) <= TOLERANCE for x, y in zip(a, b, strict=True))


def _expected(sample: dict[str, Any]) -> tuple[int, int, int] | None:
    """The colour of the frame at the sample's time; None near a change of colour."""
    frame = round((sample["time"] - sample["start"]) * FPS)
    if frame % SEGMENT < 3 or frame % SEGMENT > SEGMENT - 3:
        return None
    return COLOURS[min(frame // SEGMENT, len(COLOURS) - 1)]


def test_the_watch_page_plays_the_stream_and_ends(worker, browser):
    clip = _clip()
    frames = clip.shape[1]
    with Client(worker.uds_url) as client, chromium_page() as page:
        writer = client.open_video("watched.mp4", fps=FPS, live=True)
        writer.write(clip[:, :CHUNK])
        assert writer.watch_url is not None
        page.goto(writer.watch_url)
        assert page.evaluate("MediaSource.isTypeSupported('video/mp4; codecs=\"avc1.64001f\"')")
        errors: list[BaseException] = []

        def produce() -> None:  # at the clip's own frame rate, chunk by chunk
            try:
                for t0 in range(CHUNK, frames, CHUNK):
                    time.sleep(CHUNK / FPS)
                    writer.write(clip[:, t0 : t0 + CHUNK])
                writer.close()
            except BaseException as exc:
                errors.append(exc)
                writer.abort()

        producer = threading.Thread(target=produce)
        producer.start()
        samples = []
        deadline = time.monotonic() + 180  # real-time playback, on a loaded machine at worst
        while page.evaluate("window.framewireLive && window.framewireLive.state") != "ended":
            assert time.monotonic() < deadline, page.evaluate("window.framewireLive")
            sample = page.evaluate(READ_COLOUR, None)
            if sample["readyState"] >= 2 and sample["time"] > 0:
                samples.append(sample)
            time.sleep(0.1)
        producer.join(30)
        assert not errors and writer.result is not None and writer.result.ok
        live = page.evaluate("window.framewireLive")
        assert live["reason"] == "finished" and live["frames"] == frames
        assert page.evaluate("document.getElementById('video').ended")
        assert page.text_content("#state") == "ended (finished)"
        # It played: time went forward with enough data to go on (HAVE_FUTURE_DATA).
        times = [s["time"] for s in samples]
        assert times == sorted(times) and times[-1] - times[0] > 2
        assert any(s["readyState"] >= 3 for s in samples)
        # And it showed the clip: each colour where the clip has it, while playing ...
        judged = [(s, _expected(s)) for s in samples]
        judged = [(s, want) for s, want in judged if want is not None]
        assert {want for _, want in judged} == set(COLOURS)
        wrong = [
            (s["time"], s["colour"], want) for s, want in judged if not _close(s["colour"], want)
        ]
        assert not wrong
        # ... and every segment again when sought to.
        start = samples[0]["start"]
        for i, colour in enumerate(COLOURS):
            at = start + (i * SEGMENT + SEGMENT / 2) / FPS
            seen = page.evaluate(READ_COLOUR, at)
            if not _close(seen["colour"], colour):  # drawn before the frame was: once more
                time.sleep(1)
                seen = page.evaluate(READ_COLOUR, None)
            assert _close(seen["colour"], colour), (i, seen)
