"""vLLM-omni 0.30.0's own code against a real worker: ``load_omni_general_plugins`` finds
framewire by its entry point, and its chunked pre-encode (``ChunkedVideoMP4Session``)
returns the same MP4 bytes through the worker as with its own encoder
(tests/support/engine_vllm_omni.py runs the cases)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.engine_site import engine_site, run_engine
from tests.support.worker import free_port

pytestmark = pytest.mark.registry

ROUTED = ["wan-ultrafast", "minimax-fast-2-threads", "batch-with-audio", "mono-default-rate",
          "no-codec-options"]  # fmt: skip
BYTES = ["bytes-float32-audio", "bytes-uint8", "bytes-big-no-options", "bytes-tensor",
         "bytes-pil"]  # fmt: skip
LEFT = ["odd-size", "bytes-crf"]  # libx264 refuses the first in vLLM-omni itself


@pytest.fixture(scope="module")
def site() -> Path:
    return engine_site("vllm-omni")


def run(site: Path, names: list[str], **env: str) -> dict[str, Any]:
    # VLLM_PLUGINS names framewire: vLLM-omni's own vllm.general_plugins entry point
    # registers its models with vLLM, which is not installed here.
    return run_engine(site, "engine_vllm_omni", *names, **{"VLLM_PLUGINS": "framewire", **env})


@pytest.fixture(scope="module")
def own(site: Path) -> dict[str, Any]:
    return run(site, ROUTED + BYTES + LEFT)


def test_not_enabled_nothing_is_replaced(own):
    assert own["unchanged"] == [True, True, True]  # both encoder names, _encode_video_bytes
    assert own["counts"] == {}
    assert "avcodec_open2" in own["results"]["odd-size"]["error"]


def test_the_chunked_pre_encode_through_the_worker_has_vllm_omnis_bytes(site, own, workers):
    worker = workers.start()
    on = run(site, ROUTED + BYTES + LEFT, FRAMEWIRE_INTEGRATIONS="vllm-omni",
             FRAMEWIRE_URL=worker.uds_url)  # fmt: skip
    assert on["unchanged"] == [False, False, False]
    assert on["results"] == own["results"]
    # One stream session per batch entry (batch-with-audio has two) and per one-shot
    # encode; the odd size and another crf left to vLLM-omni.
    assert on["counts"] == {
        "vllm-omni:routed": len(ROUTED) + 1 + len(BYTES),
        "vllm-omni:engine:an odd size": 1,
        "vllm-omni:engine:codec options other than preset and threads": 1,
    }
    assert "ChunkedMP4Encoder and _encode_video_bytes encode through the worker" in on["log"]
    spool = worker.outputs / ".framewire-tmp-spool"
    assert list(worker.outputs.iterdir()) in ([], [spool]) and list(spool.iterdir()) == []


def test_no_worker_leaves_it_to_vllm_omni(site, own):
    on = run(site, ["wan-ultrafast", "batch-with-audio"], FRAMEWIRE_INTEGRATIONS="vllm-omni",
             FRAMEWIRE_URL=f"http://127.0.0.1:{free_port()}")  # fmt: skip
    assert on["results"] == {n: own["results"][n] for n in ("wan-ultrafast", "batch-with-audio")}
    assert on["counts"] == {"vllm-omni:engine:the worker answered unavailable": 3}


def test_vllm_plugins_without_framewire_loads_nothing(site, own, workers):
    """The trap: VLLM_PLUGINS is an allow-list for vLLM-omni's group too."""
    worker = workers.start()
    on = run(site, ["wan-ultrafast"], FRAMEWIRE_INTEGRATIONS="vllm-omni",
             FRAMEWIRE_URL=worker.uds_url, VLLM_PLUGINS="some-other-plugin")  # fmt: skip
    assert on["unchanged"] == [True, True, True] and on["counts"] == {}
    assert on["results"]["wan-ultrafast"] == own["results"]["wan-ultrafast"]


def test_a_worker_with_another_pyav_leaves_it_to_vllm_omni(workers):
    """vLLM-omni beside PyAV 16.1.0, the worker on the test environment's PyAV: every save
    runs vLLM-omni's own encoder, with its own PyAV's bytes."""
    site = engine_site("vllm-omni-av16")
    cases = ["wan-ultrafast", "bytes-float32-audio"]
    own = run(site, cases)
    worker = workers.start()
    on = run(site, cases, FRAMEWIRE_INTEGRATIONS="vllm-omni", FRAMEWIRE_URL=worker.uds_url)
    assert on["results"] == own["results"]
    assert on["counts"] == {"vllm-omni:engine:the worker answered encoder_unavailable": 2}
