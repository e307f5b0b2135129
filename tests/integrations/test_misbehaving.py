"""A worker at FRAMEWIRE_URL that misbehaves, for each engine's own code: one that takes a
request and never answers, one that is slow, one that says it wrote an output that is
not there (or not as it says), one whose messages are made to forge log lines. Each
engine's save still returns its own bytes, within the bound, and its log stays clean.

The worker is real; tests/support/misbehaving.py stands in front of it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.engine_site import engine_ffmpeg, engine_site, run_engine
from tests.support.misbehaving import FORGED, Fault, Misbehaving
from tests.support.worker import Worker, Workers

pytestmark = pytest.mark.registry

TOKEN = "s3cret-token-of-the-engine"
# A whole save's request, or a stream session's chunk, finish or opening.
SENT = r"POST /v1/(videos:encode|streams/[^/]+/frames)"
FAULTS = {
    "silent": Fault("silent", SENT),
    "slow": Fault("slow", SENT, delay_s=0.5),
    "lying": Fault("lying", r"POST /v1/(videos:encode|streams/[^/]+/finish)"),
    "hostile": Fault("hostile", r"POST /v1/(videos:encode|streams)"),
}
BOUND_S = {"silent": 3, "slow": 5, "lying": 5, "hostile": 5}  # FRAMEWIRE_INTEGRATION_TIMEOUT_S
CASES = {
    "sglang": ["float32", "pair"],
    "vllm-omni": ["wan-ultrafast", "bytes-uint8"],
    "diffusers": ["float32", "pil"],
}
DRIVERS = {engine: f"engine_{engine.replace('-', '_')}" for engine in CASES}


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> Iterator[Worker]:
    started = Workers(lambda: tmp_path_factory.mktemp("worker"))
    yield started.start("--encoders", str(engine_ffmpeg(engine_site("sglang"))))
    started.stop_all()


def run(engine: str, out: Path, **env: str) -> dict[str, Any]:
    """The engine's driver on its cases; for diffusers, each case also by diffusers' own
    function in the same process (``own``)."""
    args = [] if engine == "vllm-omni" else [str(out)]
    out.mkdir(parents=True, exist_ok=True)
    extra = {"VLLM_PLUGINS": "framewire"} if engine == "vllm-omni" else {}
    sites = [] if engine == "diffusers" else [engine_site(engine)]
    return run_engine(sites, DRIVERS[engine], *args, *CASES[engine], **extra, **env)


@pytest.fixture(scope="module")
def own(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """SGLang's and vLLM-omni's own saves of the cases (the integration not enabled)."""
    return {
        engine: run(engine, tmp_path_factory.mktemp(engine))["results"]
        for engine in ("sglang", "vllm-omni")
    }


def clean(log: str) -> None:
    assert TOKEN not in log
    assert not [line for line in log.splitlines() if line.startswith(FORGED)]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("engine", CASES)
def test_a_misbehaving_worker_leaves_the_engine_its_bytes(engine, fault, worker, own, tmp_path):
    env = {"FRAMEWIRE_INTEGRATION_TIMEOUT_S": str(BOUND_S[fault]), "FRAMEWIRE_TOKEN": TOKEN}
    if engine != "diffusers":
        env["FRAMEWIRE_INTEGRATIONS"] = engine
    with Misbehaving(worker.uds, tmp_path, FAULTS[fault]) as proxy:
        report = run(engine, worker.outputs / f"{engine}-{fault}", FRAMEWIRE_URL=proxy.url, **env)
    assert proxy.hits >= 1, "the fault was never met"
    clean(report["log"])
    counts = report["counts"]
    results = report["on"] if engine == "diffusers" else report["results"]
    expected = report["own"] if engine == "diffusers" else own[engine]
    seconds = report["seconds"]
    if fault == "slow":  # within the bound: through the worker
        assert results == expected
        assert set(counts) == {f"{engine}:routed"}
        return
    if engine == "vllm-omni" and fault == "lying":
        # The chunked pre-encode's chunks went back to the producer as the worker took them:
        # the encode fails as vLLM-omni's own encoder fails one; the one-shot encode runs
        # vLLM-omni's own.
        error = results.pop("wan-ultrafast")["error"]
        assert (
            error == "RuntimeError: framewire: the encode failed: [output_mismatch] the "
            "bytes the worker sent back do not have its sha256"
        )
        assert counts.pop("vllm-omni:failed:the worker's output did not check out") == 1
        expected = {k: v for k, v in expected.items() if k != "wan-ultrafast"}
    assert results == expected
    assert f"{engine}:routed" not in counts
    why = {
        "silent": f"the worker did not answer within {BOUND_S[fault]} s",
        "lying": "the worker's output did not check out",
        "hostile": "the worker answered an unknown code",
    }[fault]
    assert f"{engine}:engine:{why}" in counts, counts
    if fault == "silent":
        # Given up on after the bound, then left alone for as long again: the next save
        # does not wait.
        first, then = CASES[engine]
        assert BOUND_S[fault] <= seconds[first] < BOUND_S[fault] + 6, seconds
        assert seconds[then] < BOUND_S[fault], seconds
        assert f"{engine}:engine:the worker did not answer a moment ago" in counts
    if fault == "hostile":
        [said] = [line for line in report["log"].splitlines() if "unknown code" in line]
        assert "refused\\nframewire: FORGED LINE\\r\\x1b[31mred\\u2028" in said
        assert "token=[token]" in said
