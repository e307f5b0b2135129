"""hls.js, the player most browsers without native HLS use, from the npm registry, played in
headless Chromium (tests.support.browser): what an LL-HLS viewer of the live view runs.

``open_hls_player`` starts hls.js on a blank page and records what it does on
``window.hlsPlayer``; ``player_state``, ``player_pixel`` and ``player_frame`` read it back.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from tests.support import CACHE as MACHINE_CACHE

# The newest 1.x on the registry when pinned; the integrity is the registry's (dist.integrity),
# checked again here so that the bytes under test stay the same ones.
HLSJS_VERSION = "1.7.4"
HLSJS_INTEGRITY = "sha512-3GlxGdPvT2YHvQYOt+yOzT/DEior/qJVNIylHA77kgeoBTdQQqi70GwefNEUmHQeNGyjC8U62+bruqW/Tpm+tg=="  # noqa: E501
CACHE = MACHINE_CACHE / f"hlsjs-{HLSJS_VERSION}"
INSTALL_TIMEOUT_S = 300
# The tarball unpacks to 33 MB, mostly sources and maps: the player and its licence suffice.
KEEP = ("package/LICENSE", "package/package.json", "package/dist/hls.min.js")


def hlsjs_file() -> Path:
    """hls.min.js of the pinned version (``hlsjs_missing()`` installs it)."""
    return CACHE / "package" / "dist" / "hls.min.js"


def _installed() -> bool:
    return hlsjs_file().is_file() and (CACHE / "package" / "LICENSE").is_file()


def _integrity(path: Path) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(path.read_bytes()).digest()).decode()


def hlsjs_missing() -> str | None:
    """None once the pinned hls.js is in the cache; else why it cannot be.

    ``npm pack`` fetches the tarball into a temporary directory beside the cache, which
    is renamed into place whole: concurrent installs race only to that rename.
    """
    if _installed():
        return None
    npm = shutil.which("npm")
    if npm is None:
        return "npm missing: hls.js comes from the npm registry"
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE.parent, prefix=f".{CACHE.name}-") as tmp:
        cmd = [npm, "pack", f"hls.js@{HLSJS_VERSION}", "--pack-destination", tmp, "--silent"]
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=INSTALL_TIMEOUT_S, cwd=tmp)
        except subprocess.TimeoutExpired:
            return f"npm pack hls.js@{HLSJS_VERSION} ran past {INSTALL_TIMEOUT_S} s"
        tarball = Path(tmp) / f"hls.js-{HLSJS_VERSION}.tgz"
        if done.returncode != 0 or not tarball.is_file():
            return f"npm pack hls.js failed: {done.stderr.decode(errors='replace')[-300:]}"
        if _integrity(tarball) != HLSJS_INTEGRITY:
            return f"hls.js-{HLSJS_VERSION}.tgz does not match its pinned integrity"
        unpacked = Path(tmp) / "unpacked"
        with tarfile.open(tarball) as tar:
            try:
                members = [tar.getmember(name) for name in KEEP]
            except KeyError as exc:
                return f"hls.js-{HLSJS_VERSION}.tgz lacks {exc}"
            tar.extractall(unpacked, members=members, filter="data")
        meta = json.loads((unpacked / "package" / "package.json").read_text())
        if meta.get("version") != HLSJS_VERSION:
            return f"the tarball holds hls.js {meta.get('version')}, not {HLSJS_VERSION}"
        try:
            os.rename(unpacked, CACHE)
        except OSError:
            if not _installed():  # not another process's install: a real failure
                raise
    return None


PAGE = """<!doctype html><html><body style="margin:0;background:#000">
<video id="video" muted autoplay playsinline></video>
<canvas id="canvas"></canvas>
</body></html>"""

# Everything the tests read is plain data on window.hlsPlayer (pixel() aside), so that
# player_state() can copy it out; the Hls instance itself is window.hls.
START = """([url, config]) => {
  const video = document.getElementById("video");
  const canvas = document.getElementById("canvas");
  const state = {
    supported: Hls.isSupported(), version: Hls.version,
    canPlayNative: video.canPlayType("application/vnd.apple.mpegurl"),
    errors: [], warnings: [], ended: false, currentTime: 0, buffered: [],
    latency: null, levelDetails: null, levelUpdates: 0, playing: false,
  };
  window.hlsPlayer = state;
  const hls = new Hls(config);
  window.hls = hls;
  let bufferedEnd = 0;
  const sample = () => {
    const b = video.buffered;
    const end = b.length ? b.end(b.length - 1) : 0;
    if (end > bufferedEnd) {
      bufferedEnd = end;
      state.buffered.push([end, Date.now()]);
    }
    state.currentTime = video.currentTime;
    state.latency = Number.isFinite(hls.latency) ? hls.latency : null;
  };
  const tick = () => { sample(); requestAnimationFrame(tick); };
  requestAnimationFrame(tick);
  hls.on(Hls.Events.BUFFER_APPENDED, sample);
  for (const name of ["timeupdate", "progress"]) video.addEventListener(name, sample);
  video.addEventListener("playing", () => { state.playing = true; });
  video.addEventListener("ended", () => { sample(); state.ended = true; });
  hls.on(Hls.Events.ERROR, (_, data) => {
    const entry = {type: data.type, details: data.details, fatal: data.fatal,
                   reason: String(data.reason || data.error || ""),
                   url: data.frag ? data.frag.url : (data.url || null),
                   status: data.response ? data.response.code : null};
    const list = data.fatal ? state.errors : state.warnings;
    if (list.length < 50) list.push(entry);
  });
  hls.on(Hls.Events.LEVEL_UPDATED, (_, data) => {
    const d = data.details;
    state.levelUpdates += 1;
    state.levelDetails = {
      live: d.live, endSN: d.endSN, startSN: d.startSN,
      partList: d.partList ? d.partList.length : 0, partTarget: d.partTarget,
      canBlockReload: d.canBlockReload, targetduration: d.targetduration,
      totalduration: d.totalduration, preloadHint: Boolean(d.preloadHint),
    };
  });
  hls.on(Hls.Events.MANIFEST_PARSED, () => {
    video.play().catch((e) => state.warnings.push({type: "play", details: String(e)}));
  });
  hls.on(Hls.Events.MEDIA_ATTACHED, () => hls.loadSource(url));
  hls.attachMedia(video);
  // MSE plays from a blob: URL of this page, so the canvas is not tainted by the
  // cross-origin segments and getImageData works.
  state.pixel = (x, y) => {
    if (!video.videoWidth) return null;
    canvas.width = video.videoWidth;
    canvas.height = video.videoHeight;
    const g = canvas.getContext("2d", {willReadFrequently: true});
    g.drawImage(video, 0, 0);
    const d = g.getImageData(x, y, 1, 1).data;
    return [d[0], d[1], d[2]];
  };
}"""


def open_hls_player(
    page: Any, url: str, *, low_latency: bool = True, **config: float | bool
) -> None:
    """Play ``url`` (an absolute http URL; the server allows any origin) with hls.js on
    ``page``, a blank page (``fresh_page``); call ``hlsjs_missing()`` first.
    ``config``: more of hls.js's settings by their own names (maxLiveSyncPlaybackRate)."""
    page.set_content(PAGE)
    page.add_script_tag(path=str(hlsjs_file()))
    page.evaluate(START, [url, {"lowLatencyMode": low_latency, **config}])


def player_state(page: Any) -> dict[str, Any]:
    """A copy of ``window.hlsPlayer``'s data (errors, ended, currentTime, buffered, ...)."""
    state: dict[str, Any] = page.evaluate("() => JSON.parse(JSON.stringify(window.hlsPlayer))")
    return state


def player_pixel(page: Any, x: int, y: int) -> list[int] | None:
    """The [r, g, b] of the video frame on screen at (x, y); None before the first frame."""
    pixel: list[int] | None = page.evaluate("([x, y]) => window.hlsPlayer.pixel(x, y)", [x, y])
    return pixel


def player_frame(page: Any, x: int, y: int) -> tuple[float, list[int]] | None:
    """The video's currentTime and the [r, g, b] on screen at (x, y), read in one task (a
    currentTime sampled apart can be stale by a seek: hls.js jumps to the live edge);
    None before the first frame."""
    got: list[Any] | None = page.evaluate(
        "([x, y]) => { const p = window.hlsPlayer.pixel(x, y);"
        " return p && [document.getElementById('video').currentTime, p]; }",
        [x, y],
    )
    return None if got is None else (float(got[0]), got[1])
