"""The guards are guarded: each mutation of tests/support/mutants runs against the tests
that claim to catch it, in a pytest of its own (the mutation in each of its processes),
and every one of them must fail."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support import REPO
from tests.support.mutants import sitecustomize

GUARDS = {
    # Tests that say they go through the worker: with the client's every request failing
    # as a dead worker's, they fail (none passes on the local fallback's equal bytes).
    "dead_worker": [
        "tests/client/test_stream_audio.py",
        "tests/service/sources/test_cuda_release.py::"
        "test_a_tensor_torch_will_not_share_goes_by_host_a_chunk_at_a_time",
        "tests/service/cli/test_cli.py::test_encode_takes_a_fractional_quality_and_a_profile[False]",
        "tests/service/http/test_app.py::test_cli_encode_and_probe_through_worker",
    ],
    # The decode tests hold the product's decode against the contract's command.
    "bicubic_decode": [
        "tests/service/decode/test_decoder.py::test_local_fallback_is_byte_exact",
        "tests/service/decode/test_decoder.py::test_a_local_decode_reports_the_frames_it_wrote",
        "tests/service/fdsocket/test_decodes.py::test_worker_decode_is_byte_exact_and_cached",
        "tests/client/test_distributed.py::test_without_a_process_group_it_is_a_plain_decode",
    ],
}


@pytest.mark.parametrize("mutant", sorted(GUARDS))
def test_each_guard_fails_under_the_mutation_it_guards_against(mutant, tmp_path):
    site = sitecustomize(mutant, tmp_path)  # its own temp dirs too: none of this run's
    path = os.pathsep.join(filter(None, [str(site), str(REPO), os.environ.get("PYTHONPATH")]))
    # Under CI=true pytest spells out every failed comparison in full: the frames' bytes
    # took minutes. The failures are what counts here, not their diffs.
    without_ci = {k: v for k, v in os.environ.items() if k != "CI"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE",
         "--no-header", "--basetemp", str(tmp_path / "run"), *GUARDS[mutant]],
        cwd=REPO, env=without_ci | {"PYTHONPATH": path, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    tail = run.stdout[-3000:]
    assert run.returncode == 1, tail  # test failures (2+: the run itself broke)
    summary = run.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ failed", summary) and "passed" not in summary, tail
