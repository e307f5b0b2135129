"""vLLM-omni's own code (0.26.0 to 0.30.0) against a real worker:
``load_omni_general_plugins`` finds framewire by its entry point, and its chunked
pre-encode (``ChunkedVideoMP4Session``, 0.30) and its one-shot ``_encode_video_bytes``
return the same MP4 bytes through the worker as with its own encoder
(tests/support/engine_vllm_omni.py runs the cases). The full set at 0.30.0; at 0.26.0
and 0.28.0 a smoke set; a module whose targets drifted, a version outside the range and
a failure of framewire's at each stage all leave vLLM-omni's own code running."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.engine_faults import STAGES
from tests.support.engine_site import VERSIONS, engine_site, fake_version, overlay, run_engine
from tests.support.processes import is_spool, spools
from tests.support.worker import Worker, Workers, free_port

pytestmark = pytest.mark.registry

ROUTED = ["wan-ultrafast", "minimax-fast-2-threads", "batch-with-audio", "mono-default-rate",
          "no-codec-options", "encoder-uint8"]  # fmt: skip
BYTES = ["bytes-float32-audio", "bytes-uint8", "bytes-big-no-options", "bytes-tensor",
         "bytes-pil"]  # fmt: skip
LEFT = ["odd-size", "bytes-crf"]  # libx264 refuses the first in vLLM-omni itself
MEDIA = "vllm_omni.diffusion.utils.media_utils"
CHUNKED = "vllm_omni.diffusion.utils.chunked_video"
API = "vllm_omni.entrypoints.openai.video_api_utils"
API_FILE = "vllm_omni/entrypoints/openai/video_api_utils.py"


def warnings(log: str) -> list[str]:
    return [line for line in log.splitlines() if "framewire.integrations WARNING" in line]


@pytest.fixture(scope="module")
def site() -> Path:
    return engine_site("vllm-omni")


def run(site: Path | list[Path], names: list[str], **env: str) -> dict[str, Any]:
    # VLLM_PLUGINS names framewire: vLLM-omni's own vllm.general_plugins entry point
    # registers its models with vLLM, which is not installed here.
    return run_engine(site, "engine_vllm_omni", *names, **{"VLLM_PLUGINS": "framewire", **env})


@pytest.fixture(scope="module")
def own(site: Path) -> dict[str, Any]:
    return run(site, ROUTED + BYTES + LEFT)


EVERY = {"media": True, "chunked": True, "session": True, "bytes": True}
REPLACED = [
    f"{MEDIA}.ChunkedMP4Encoder",
    f"{CHUNKED}.ChunkedVideoMP4Session",
    f"{API}._encode_video_bytes",
]


def test_not_enabled_nothing_is_replaced(own):
    assert own["unchanged"] == EVERY
    assert own["hooked"] == {}
    assert own["counts"] == {}
    assert "avcodec_open2" in own["results"]["odd-size"]["error"]


def test_the_chunked_pre_encode_through_the_worker_has_vllm_omnis_bytes(site, own, workers):
    worker = workers.start()
    on = run(site, ROUTED + BYTES + LEFT, FRAMEWIRE_INTEGRATIONS="vllm-omni",
             FRAMEWIRE_URL=worker.uds_url)  # fmt: skip
    assert on["unchanged"] == dict.fromkeys(EVERY, False)
    assert on["hooked"] == dict.fromkeys(REPLACED, True)
    assert on["results"] == own["results"]
    # The sessions' host chunks quantized by the worker, none here; the odd size's by
    # vLLM-omni, which has it whole.
    sessions = [n for n in own["quantized"] if n != "odd-size"]
    assert all(own["quantized"][n] > 0 for n in own["quantized"])
    assert on["quantized"] == {n: 0 for n in sessions} | {"odd-size": own["quantized"]["odd-size"]}
    # One stream session per batch entry (batch-with-audio has two) and per one-shot
    # encode; the odd size and another crf left to vLLM-omni.
    assert on["counts"] == {
        "vllm-omni:routed": len(ROUTED) + 1 + len(BYTES),
        "vllm-omni:engine:an odd size": 1,
        "vllm-omni:engine:codec options other than preset and threads": 1,
    }
    said = "ChunkedMP4Encoder, ChunkedVideoMP4Session and _encode_video_bytes encode through"
    assert said in on["log"]
    assert warnings(on["log"]) == []
    assert [p for p in worker.outputs.iterdir() if not is_spool(p)] == []
    assert all(list(spool.iterdir()) == [] for spool in spools(worker.outputs))


def test_no_worker_leaves_it_to_vllm_omni(site, own):
    on = run(site, ["wan-ultrafast", "batch-with-audio"], FRAMEWIRE_INTEGRATIONS="vllm-omni",
             FRAMEWIRE_URL=f"http://127.0.0.1:{free_port()}")  # fmt: skip
    assert on["results"] == {n: own["results"][n] for n in ("wan-ultrafast", "batch-with-audio")}
    # Once per session (batch-with-audio's two encoders are its own, not asked again).
    assert on["counts"] == {"vllm-omni:engine:the worker answered unavailable": 2}


def test_vllm_plugins_without_framewire_loads_nothing(site, own, workers):
    """The trap: VLLM_PLUGINS is an allow-list for vLLM-omni's group too."""
    worker = workers.start()
    on = run(site, ["wan-ultrafast"], FRAMEWIRE_INTEGRATIONS="vllm-omni",
             FRAMEWIRE_URL=worker.uds_url, VLLM_PLUGINS="some-other-plugin")  # fmt: skip
    assert on["unchanged"] == EVERY and on["counts"] == {}
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


# --- every version of the range, drift, versions outside it, failures of framewire's ---


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Iterator[Worker]:
    """One worker for the module's runs at every version."""
    started = Workers(lambda: tmp_path_factory.mktemp("vllm-omni-worker"))
    yield started.start()
    started.stop_all()


SMOKE = ["bytes-uint8", "bytes-tensor", "bytes-float32-audio"]
# A copy of video_api_utils whose _encode_video_bytes takes one more parameter: its last
# parameter (0.26's video_codec_options, then frame_converter) and the new one.
LAST = {"0.26.0": "    video_codec_options: dict[str, str] | None = None,\n) -> bytes:"}
DRIFTED_LAST = "    frame_converter: _PlanarFrameConverter | None = None,\n) -> bytes:"


def drift(version: str) -> tuple[str, str]:
    last = LAST.get(version, DRIFTED_LAST)
    return last, last.replace("\n) -> bytes:", "\n    tune: str | None = None,\n) -> bytes:")


@pytest.mark.parametrize("version", VERSIONS["vllm-omni"][:-1])
def test_an_older_version_routes_what_it_verified(version, shared, tmp_path):
    """0.26.0 and 0.28.0: no chunked pre-encode; their one-shot encode routed, but 0.26's
    audio (muxed without the timestamps later versions give it: other bytes)."""
    site = engine_site("vllm-omni", version)
    own = run(site, SMOKE)
    assert all(isinstance(r, list) for r in own["results"].values()), own["results"]
    on = run(site, SMOKE, FRAMEWIRE_INTEGRATIONS="vllm-omni", FRAMEWIRE_URL=shared.uds_url)
    assert on["results"] == own["results"]
    assert on["unchanged"] == {"bytes": False}
    assert on["hooked"] == {f"{API}._encode_video_bytes": True}
    if version == "0.26.0":
        assert on["counts"] == {
            "vllm-omni:routed": 2,
            "vllm-omni:engine:audio, which vLLM-omni 0.26 muxes without timestamps": 1,
        }
    else:
        assert on["counts"] == {"vllm-omni:routed": 3}
    assert warnings(on["log"]) == []


@pytest.mark.parametrize("version", VERSIONS["vllm-omni"])
def test_a_drifted_target_is_left_to_vllm_omni_with_one_warning(version, shared, tmp_path):
    site = engine_site("vllm-omni", version)
    root = overlay(tmp_path / "overlay", site, API_FILE, drift(version))
    cases = ["bytes-uint8", *(["wan-ultrafast"] if version == "0.30.0" else [])]
    own = run(site, cases)
    on = run(site, cases, FRAMEWIRE_INTEGRATIONS="vllm-omni", FRAMEWIRE_URL=shared.uds_url,
             FRAMEWIRE_TEST_OVERLAY=str(root))  # fmt: skip
    assert on["results"] == own["results"]
    [said] = warnings(on["log"])
    assert f"vLLM-omni {version}: {API}._encode_video_bytes has the parameters (" in said
    assert "tune=None" in said
    if version == "0.30.0":  # the chunked pre-encode did not drift: still routed
        assert on["hooked"] == dict.fromkeys(REPLACED[:2], True)
        assert on["counts"] == {"vllm-omni:routed": 1}
    else:
        assert (on["hooked"], on["counts"]) == ({}, {})


def test_a_version_outside_the_range_is_left_to_vllm_omni(site, own, shared, tmp_path):
    newer = [fake_version(tmp_path / "meta", "vllm-omni", "0.31.0"), site]
    on = run(newer, ["wan-ultrafast", "bytes-uint8"], FRAMEWIRE_INTEGRATIONS="vllm-omni",
             FRAMEWIRE_URL=shared.uds_url)  # fmt: skip
    assert on["results"] == {n: own["results"][n] for n in ("wan-ultrafast", "bytes-uint8")}
    assert (on["hooked"], on["counts"]) == ({}, {})
    [said] = warnings(on["log"])
    assert "vLLM-omni 0.31.0 is outside the versions verified (0.26.0-0.30.0)" in said


@pytest.mark.parametrize("stage", STAGES)
def test_a_failure_of_framewires_at_any_stage_leaves_vllm_omni_running(site, own, shared, stage):
    cases = ["wan-ultrafast", "bytes-uint8"]
    on = run(site, cases, FRAMEWIRE_INTEGRATIONS="vllm-omni", FRAMEWIRE_URL=shared.uds_url,
             FRAMEWIRE_TEST_INJECT=stage)  # fmt: skip
    assert on["results"] == {n: own["results"][n] for n in cases}
    said = warnings(on["log"])
    assert len(said) == 1 and "injected failure\\nframewire: FORGED LINE" in said[0], said
    assert "Traceback" not in on["log"]
    assert not [line for line in on["log"].splitlines() if line.startswith("framewire: FORGED")]
    expected = {
        "probe": ({}, {}),
        "register": ({}, {}),
        "check": (dict.fromkeys(REPLACED, True), {"vllm-omni:routed": 2}),
        "save": (dict.fromkeys(REPLACED, True),
                 {"vllm-omni:engine:framewire failed (RuntimeError)": 2}),
    }  # fmt: skip
    assert (on["hooked"], on["counts"]) == expected[stage]
