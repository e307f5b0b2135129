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
  threads   two threads save views of one batch tensor at once; the results
  cancel_then_overwrite
            an async save cancelled after "cancel_s", the tensor overwritten at once,
            then the clip saved again to the second path; what each did

A CLIP may ask for "specials" (NaN, infinities, values out of range); a save may name a
"profile", and with "memory": true reports what it left allocated on the GPU.

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
    clip = make_clip(**make, layout=layout)
    if spec.get("specials"):  # NaN, infinities and values out of [0, 1], the same anywhere
        flat = clip.view(-1)
        for i, value in enumerate((float("nan"), float("inf"), -float("inf"), 1.7, -0.3)):
            flat[i * 97 % flat.numel()] = value
    clip = clip.to(device)
    if view == "batch":
        other = make_clip(**(make | {"seed": make["seed"] + 100}), layout=layout).to(device)
        return torch.stack([other, clip])[1], layout
    return clip, layout


def save(spec: dict[str, Any]) -> Any:
    from framewire.client import Client, FramewireError

    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()  # before the clips: what the rank had
    clips = [clip_for(c, "cuda") for c in spec["clips"]]
    layouts = {layout for _, layout in clips}
    assert len(layouts) == 1, "one request, one layout"
    options = {k: spec[k] for k in ("profile",) if k in spec}
    try:
        with Client(spec["url"], timeout=300) as client:
            results = client.save_videos(
                [t for t, _ in clips], spec["paths"], fps=24, layout=layouts.pop(), **options
            )
    except FramewireError as exc:
        return {"error": exc.code, "message": exc.message}
    answer = [r.model_dump(mode="json") for r in results]
    if spec.get("memory"):  # what the save left allocated once the clips are dropped
        del clips
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
        torch.cuda.ipc_collect()  # what torch frees once consumers counted down
        return {"results": answer, "baseline": baseline, "after": after,
                "after_ipc_collect": torch.cuda.memory_allocated()}  # fmt: skip
    return answer


def threads(spec: dict[str, Any]) -> Any:
    """Two threads of this process save views of one batch tensor at once (SGLang's
    parallel save): one allocation, its handle opened twice by the worker at once."""
    from concurrent.futures import ThreadPoolExecutor

    from framewire.client import Client

    clips = [clip_for(c, "cpu")[0] for c in spec["clips"]]
    batch = torch.stack(clips).to("cuda")
    with Client(spec["url"], timeout=300) as client, ThreadPoolExecutor(len(clips)) as pool:
        done = [pool.submit(client.save_video, batch[i], path, fps=24)
                for i, path in enumerate(spec["paths"])]  # fmt: skip
        return [d.result().model_dump(mode="json") for d in done]


def cancel_then_overwrite(spec: dict[str, Any]) -> Any:
    """An async save cancelled after ``cancel_s``, the tensor overwritten at once; then a
    save of the clip again. The first must leave nothing, the second be the clip's bytes:
    the worker never read the overwritten memory into a file."""
    import asyncio

    from framewire.client import AsyncClient

    tensor, layout = clip_for(spec["clips"][0], "cuda")

    async def go() -> dict[str, Any]:
        async with AsyncClient(spec["url"], timeout=300, local_fallback=False) as client:
            first = asyncio.ensure_future(
                client.save_video(tensor, spec["paths"][0], fps=24, layout=layout)
            )
            await asyncio.sleep(spec["cancel_s"])
            first.cancel()
            cancelled = True
            try:
                await first
                cancelled = False
            except asyncio.CancelledError:
                pass
            tensor.fill_(0.5)  # the rank reuses its buffer at once
            again, _ = clip_for(spec["clips"][0], "cuda")
            second = await client.save_video(again, spec["paths"][1], fps=24, layout=layout)
            for thread in client._release_later.threads:
                await asyncio.to_thread(thread.join, 300)
            return {"cancelled": cancelled, "second": second.model_dump(mode="json")}

    return asyncio.run(go())


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
    modes = {"save": save, "stream": stream, "region": region, "threads": threads,
             "cancel_then_overwrite": cancel_then_overwrite}  # fmt: skip
    result = modes[mode](spec)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
