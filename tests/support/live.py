"""Stream sessions with a live view, driven over the worker's HTTP API by a test."""

from __future__ import annotations

from typing import Any

import httpx
import torch

from tests.support.segments import Segments


def open_stream(h: httpx.Client, clip: torch.Tensor, path: str, **over: Any) -> dict[str, Any]:
    """``POST /v1/streams`` for ``clip``'s size at 24 fps (``over`` replaces fields)."""
    _, _, height, width = clip.shape
    body = {"path": path, "fps": 24, "dtype": "float32", "height": height, "width": width}
    r = h.post("/v1/streams", json=body | over)
    assert r.status_code == 201, r.text
    return r.json()


def send(h: httpx.Client, segments: Segments, sid: str, clip: torch.Tensor, t0: int, t1: int):
    """Frames ``[t0, t1)`` of ``clip`` into session ``sid``, through shared memory."""
    source = segments.source(clip[:, t0:t1].contiguous())
    r = h.post(f"/v1/streams/{sid}/frames", json={"first_frame": t0, "source": source})
    assert r.status_code == 200, r.text
