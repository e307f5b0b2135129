"""An inference-process stand-in for the CUDA tests: clips on the GPU, handed to a worker.

    python -m tests.cuda_producer SPEC.json-text

SPEC: {"mode", "url", "clips": [CLIP, ...], "paths": [...], "layout", ...}; CLIP:
{"frames", "height", "width", "dtype", "layout", "seed", "view"} where view is
"plain", "batch" (the clip is item 1 of a batch: a nonzero storage offset) or
"strided" (a THWC permute of a CTHW clip). Modes, each printing one JSON line:

  save      Client.save_videos of the clips; the results, or the error's code
  describe  the first clip's cuda_ipc descriptor, then holds the clip until stdin
            closes; with "exit": true it exits at once instead, without releasing
            anything, so the handle it printed names freed memory
  region    registers the first clip's allocation as a CUDA region, encodes from it,
            reads the region's status, unregisters it; what each step answered

A process of its own: CUDA IPC handles cannot be opened by the process that made them.
"""

from __future__ import annotations

import base64
import json
import os
import sys
from typing import Any

import torch
from framewire.client.wire import Layout

from tests.support.http import http_client
from tests.support.media import make_clip

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
}


def clip_for(
    spec: dict[str, Any], device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, Layout]:
    """The tensor a CLIP spec names, on ``device``, and its layout (same values anywhere)."""
    layout = Layout(spec.get("layout", "CTHW"))
    view = spec.get("view", "plain")
    make = {
        "frames": spec["frames"],
        "height": spec["height"],
        "width": spec["width"],
        "dtype": DTYPES[spec["dtype"]],
        "seed": spec.get("seed", 0),
    }
    if view == "strided":
        return make_clip(**make).to(device).permute(1, 2, 3, 0), Layout.THWC
    clip = make_clip(**make, layout=layout).to(device)
    if view == "batch":
        other = make_clip(**(make | {"seed": make["seed"] + 100}), layout=layout).to(device)
        return torch.stack([other, clip])[1], layout
    return clip, layout


def save(spec: dict[str, Any]) -> Any:
    from framewire.client import Client, FramewireError

    clips = [clip_for(c, "cuda") for c in spec["clips"]]
    layouts = {layout for _, layout in clips}
    assert len(layouts) == 1, "one request, one layout"
    try:
        with Client(spec["url"], timeout=300) as client:
            results = client.save_videos(
                [t for t, _ in clips], spec["paths"], fps=24, layout=layouts.pop()
            )
    except FramewireError as exc:
        return {"error": exc.code, "message": exc.message}
    return [r.model_dump(mode="json") for r in results]


def stream(spec: dict[str, Any]) -> Any:
    """``open_video`` with the clip's CUDA chunks of ``spec["chunks"]`` frames each."""
    from framewire.client import Client, FramewireError
    from framewire.service._convert.convert import slice_frames

    tensor, layout = clip_for(spec["clips"][0], "cuda")
    try:
        with (
            Client(spec["url"], timeout=300) as client,
            client.open_video(spec["paths"][0], fps=24, layout=layout) as writer,
        ):
            t0 = 0
            for n in spec["chunks"]:
                writer.write(slice_frames(tensor, layout, t0, t0 + n))
                t0 += n
    except FramewireError as exc:
        return {"error": exc.code, "message": exc.message}
    assert writer.result is not None
    return writer.result.model_dump(mode="json")


def describe(spec: dict[str, Any]) -> None:
    from framewire.client._sharing import share

    tensor, layout = clip_for(spec["clips"][0], "cuda")
    ctx = share(tensor, layout=layout)
    source = ctx.__enter__()
    print(json.dumps(source.model_dump(mode="json", exclude_none=True)), flush=True)
    if spec.get("exit"):
        os._exit(0)  # no release, no cleanup: the memory goes with the process
    sys.stdin.read()
    ctx.__exit__(None, None, None)


def region(spec: dict[str, Any]) -> dict[str, Any]:

    tensor, layout = clip_for(spec["clips"][0], "cuda")
    storage = tensor.untyped_storage()
    torch.cuda.synchronize()
    device, handle, _, offset, counter, counter_offset, _, _ = storage._share_cuda_()
    out: dict[str, Any] = {"storage_offset_bytes": offset}
    name = spec["name"]
    with http_client("http://framewire", uds=spec["uds"], timeout=120) as h:
        base = f"/v2/cudasharedmemory/region/{name}"
        body = {
            "raw_handle": {"b64": base64.b64encode(handle).decode()},
            "device_id": device,
            "byte_size": storage.nbytes() + offset,
        }
        r = h.post(f"{base}/register", json=body)
        out["register"] = [r.status_code, r.json()]
        source = {
            "kind": "region",
            "region": name,
            "offset": offset + tensor.storage_offset() * tensor.element_size(),
            "byte_size": tensor.numel() * tensor.element_size(),
            "dtype": spec["clips"][0]["dtype"],
            "shape": list(tensor.shape),
            "layout": layout.value,
        }
        output = {"source": source, "path": spec["paths"][0], "fps": 24}
        r = h.post("/v1/videos:encode", json={"outputs": [output]})
        out["encode"] = [r.status_code, r.json()]
        out["status"] = h.get("/v2/cudasharedmemory/status").json()
        out["system_status"] = h.get("/v2/systemsharedmemory/status").json()
        out["unregister"] = h.post(f"{base}/unregister").status_code
        out["after"] = h.get(f"{base}/status").status_code
    torch.UntypedStorage._release_ipc_counter_cuda(counter, counter_offset)
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    mode = spec["mode"]
    if mode == "describe":
        describe(spec)
        return
    result = {"save": save, "stream": stream, "region": region}[mode](spec)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
