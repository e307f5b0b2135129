"""The worker's conversion route (FRAMEWIRE_KERNEL): reported in /v1/info, and byte-exact
whichever it is (the default, compiled, runs in every other encode test)."""

from __future__ import annotations

import os
import subprocess
import sys

from framewire.client import Client

from tests.support.media import make_clip, reference_mp4, with_specials


def test_a_worker_on_the_pure_route_gives_the_same_bytes(workers, tmp_path):
    w = workers.start("--kernel", "pure")
    with w.http() as h:
        assert h.get("/v1/info").json()["conversion"] == "pure"
    clip = with_specials(make_clip(frames=5, height=40, width=56))
    with Client(w.uds_url) as c:
        result = c.save_video(clip, "pure.mp4", fps=24)
    assert result.sha256 == reference_mp4(clip, tmp_path / "ref.mp4")


def test_a_default_worker_reports_the_compiled_route(worker):
    with worker.http() as h:
        assert h.get("/v1/info").json()["conversion"] == "compiled"


def test_warming_compiles_the_signatures_an_encode_uses():
    """kernels.warm() (run as a worker starts) leaves nothing for the first encode to
    compile: converting a block adds no signature to any kernel (the vllm-omni
    profile's too)."""
    import torch
    from framewire.client.wire import Layout
    from framewire.service._convert import kernels
    from framewire.service._convert.convert import convert_into
    from framewire.service._encode.profiles import vllm_omni_convert

    kernels.use("auto")
    kernels.warm()
    found = kernels.kernels()
    assert found is not None
    every = list(found)
    before = [list(k.signatures) for k in every]
    assert all(before)
    planar = make_clip(2, 8, 8)
    interleaved = planar.permute(1, 2, 3, 0).contiguous()
    for layout, clip in [(Layout.CTHW, planar), (Layout.THWC, interleaved)]:
        convert_into(clip, layout, torch.empty(2, 8, 8, 3, dtype=torch.uint8))
    vllm_omni_convert((-1.0, 1.0))(
        interleaved, Layout.THWC, torch.empty(2, 8, 8, 3, dtype=torch.uint8)
    )
    assert [list(k.signatures) for k in every] == before


def test_later_processes_load_the_kernels_from_numba_s_cache(tmp_path):
    """A worker's start compiles once per host, then loads: the cache does not grow with
    every process that starts (a kernel that closed over another compiled function
    was keyed differently in each process, compiled again and added an entry)."""
    warm = "from framewire.service._convert import kernels; kernels.use('compiled'); kernels.warm()"
    env = os.environ | {"NUMBA_CACHE_DIR": str(tmp_path)}

    def cached() -> dict[str, int]:
        subprocess.run([sys.executable, "-c", warm], env=env, check=True, timeout=120)
        return {p.name: p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()}

    first = cached()
    assert any(name.endswith(".nbc") for name in first), first  # compiled, and written
    assert cached() == first
    assert cached() == first
