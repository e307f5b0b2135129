"""The watch page: a ``<video>`` fed through Media Source Extensions by a small feeder,
or playing the view's HLS playlist natively where the browser has no MSE.

Which player: Media Source Extensions wherever ``MediaSource`` exists (its delay is the
encoder's plus a fragment: the lowest), the browser's own HLS player where it does not
(iPhone Safari before iOS 17.1), ``?player=hls`` or ``?player=mse`` to choose. No
player library is served: a page that wants hls.js loads its own and plays
``hls_url`` (any origin may: the signature grants access).

The feeder reads ``live.mp4`` (same directory, same signed query) with ``fetch``
streams, cuts it into top-level boxes, appends the init segment and then each
``moof`` + ``mdat`` pair to one SourceBuffer, and ends the media source at the
worker's ``free`` end box. It reports what it sees on ``window.framewireLive``
(state, frames received, when each fragment became playable) for tests and
benchmarks. No external script or style: the page's Content-Security-Policy
allows only the nonce'd inline ones.
"""

from __future__ import annotations

import html

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>framewire live: {stream_id}</title>
<style nonce="{nonce}">
body {{ font: 14px system-ui, sans-serif; margin: 1em; background: #111; color: #ddd; }}
video {{ max-width: 100%; background: #000; display: block; }}
b {{ color: #fff; font-variant-numeric: tabular-nums; }}
</style></head>
<body>
<video id="video" muted autoplay playsinline></video>
<p>state <b id="state">connecting</b> · frames received <b id="frames">0</b>
 · delay <b id="delay">-</b></p>
<script nonce="{nonce}">
"use strict";
(async () => {{
  const live = window.framewireLive = {{state: "connecting", reason: null, frames: 0,
    playable: [], codecs: null, player: null}};
  const video = document.getElementById("video");
  const show = (id, text) => {{ document.getElementById(id).textContent = text; }};
  const setState = (s) => {{ live.state = s; show("state", live.reason ? s + " (" +
    live.reason + ")" : s); }};
  const asked = new URLSearchParams(location.search).get("player");
  const native = video.canPlayType("application/vnd.apple.mpegurl") !== "";
  live.player = asked === "hls" || (asked !== "mse" && !window.MediaSource && native)
    ? "hls" : "mse";
  if (live.player === "hls") {{
    video.addEventListener("playing", () => {{ live.reason = null; setState("playing"); }});
    video.addEventListener("ended", () => {{ live.reason = "finished"; setState("ended"); }});
    // A media error (Chromium's player has raised "not supported" on a busy host, once
    // in a while, for a playlist it plays when asked again): the live edge anew, twice.
    live.retries = 0;
    video.addEventListener("error", () => {{
      live.reason = "media error " + (video.error ? video.error.code : "");
      if (live.retries >= 2) {{ setState("error"); return; }}
      live.retries += 1;
      setState("retrying");
      setTimeout(() => {{
        video.src = "live.m3u8" + location.search;
        video.play().catch(() => {{}});  // autoplay decides; "playing" reports it
      }}, 1000);
    }});
    // A player without parts refuses a playlist that lists no whole segment yet: wait
    // for the first (it runs to the first keyframe after the start: at most 250 frames).
    for (;;) {{
      const r = await fetch("live.m3u8" + location.search, {{cache: "no-store"}});
      if (!r.ok) {{ live.reason = (await r.json()).code; setState("error"); return; }}
      if ((await r.text()).includes("#EXTINF")) break;
      await new Promise((done) => setTimeout(done, 500));
    }}
    video.src = "live.m3u8" + location.search;
    return;
  }}
  const u32 = (b, i) => ((b[i] << 24) | (b[i + 1] << 16) | (b[i + 2] << 8) | b[i + 3]) >>> 0;
  const kind = (b, i) => String.fromCharCode(b[i], b[i + 1], b[i + 2], b[i + 3]);
  const find = (b, name) => {{
    for (let i = 0; i + 4 <= b.length; i++) if (kind(b, i) === name) return i;
    return -1;
  }};
  const hex = (n) => n.toString(16).padStart(2, "0");
  const codecsOf = (init) => {{
    const c = find(init, "avcC");
    const list = ['avc1.' + hex(init[c + 5]) + hex(init[c + 6]) + hex(init[c + 7])];
    if (find(init, "mp4a") >= 0) list.push("mp4a.40.2");
    return list.join(",");
  }};
  // Samples of the first track fragment (the video) of a moof.
  const samples = (moof) => {{
    const t = find(moof, "trun");
    return t < 0 ? 0 : u32(moof, t + 8);
  }};
  const source = new MediaSource();
  video.src = URL.createObjectURL(source);
  await new Promise((r) => source.addEventListener("sourceopen", r, {{once: true}}));
  let buffer = null, ended = false;
  const queue = [];  // [bytes, frames after it]
  // One append at a time, and one updateend handler for all of them: the buffer stops
  // "updating" a task before its updateend fires, so a listener added per append could
  // be spent on the previous append's event and leave the rest of the queue unappended.
  let appending = null;  // frames after the fragment being appended, while one is
  const appended = () => {{
    if (appending) live.playable.push([appending, Date.now()]);
    appending = null;
    const r = video.buffered;
    if (r.length && video.currentTime < r.start(0)) video.currentTime = r.start(0);
    pump();
  }};
  const pump = () => {{
    if (buffer === null || appending !== null) return;
    if (queue.length) {{
      const [bytes, frames] = queue.shift();
      appending = frames;
      buffer.appendBuffer(bytes);
    }} else if (ended && source.readyState === "open") {{
      source.endOfStream();
    }}
  }};
  const tick = () => {{
    const r = video.buffered;
    if (r.length) show("delay", (r.end(r.length - 1) - video.currentTime).toFixed(2) + " s");
    if (video.ended) setState("ended");
    else if (!ended && video.readyState >= 3 && !video.paused) setState("playing");
    if (!video.ended) requestAnimationFrame(tick);
  }};
  requestAnimationFrame(tick);
  let pending = new Uint8Array(0), init = [], moof = null;
  const take = (box, name) => {{
    if (name === "free") {{
      const text = new TextDecoder().decode(box.subarray(8));
      if (text.startsWith('{{"framewire"')) {{
        live.reason = JSON.parse(text).reason;
        ended = true;
      }}
    }} else if (buffer === null && (name === "ftyp" || name === "moov")) {{
      init.push(box);
      if (name === "moov") {{
        const all = new Uint8Array(init.reduce((n, b) => n + b.length, 0));
        init.reduce((at, b) => (all.set(b, at), at + b.length), 0);
        live.codecs = codecsOf(all);
        buffer = source.addSourceBuffer('video/mp4; codecs="' + live.codecs + '"');
        buffer.addEventListener("updateend", appended);
        queue.push([all, 0]);
        setState("buffering");
      }}
    }} else if (name === "moof") {{
      moof = box;
    }} else if (name === "mdat" && moof !== null) {{
      const both = new Uint8Array(moof.length + box.length);
      both.set(moof); both.set(box, moof.length);
      live.frames += samples(moof);
      show("frames", String(live.frames));
      queue.push([both, live.frames]);
      moof = null;
    }}
  }};
  try {{
    const response = await fetch("live.mp4" + location.search, {{cache: "no-store"}});
    if (!response.ok) throw new Error((await response.json()).code);
    const reader = response.body.getReader();
    for (;;) {{
      const {{value, done}} = await reader.read();
      if (done) break;
      const joined = new Uint8Array(pending.length + value.length);
      joined.set(pending); joined.set(value, pending.length);
      let at = 0;
      while (joined.length - at >= 8) {{
        const size = u32(joined, at);
        if (size < 8 || joined.length - at < size) break;
        take(joined.slice(at, at + size), kind(joined, at + 4));
        at += size;
      }}
      pending = joined.slice(at);
      pump();
    }}
    if (!ended) {{ live.reason = "disconnected"; ended = true; }}
    if (live.reason !== "finished") setState("stopped");
    pump();
  }} catch (error) {{
    live.reason = String(error.message || error);
    setState("error");
  }}
}})();
</script>
</body></html>
"""


def watch_page(stream_id: str, nonce: str) -> str:
    return _PAGE.format(stream_id=html.escape(stream_id), nonce=nonce)
