"""Schemathesis against a real worker, driven by the worker's own OpenAPI schema.

Every operation in the worker's ``/openapi.json`` gets schema-valid (positive)
and schema-violating (negative) requests, sent over TCP to a ``framewire serve``
process with a valid bearer token. For each answer: no 5xx, and every 4xx is
JSON in the worker's error shape ``{"error": str, "code": str, ...}`` with a
stable snake_case ``code``. Afterwards the worker is still running, answers
``/healthz``, has logged no unhandled exception and has written nothing.

Bounded: ``MAX_EXAMPLES`` cases per operation and mode, derandomized (the same
cases on every run), no deadline, no example database; the module takes seconds.

The schema exists only once the worker runs, so the cases come from each
operation's ``as_strategy`` inside a test rather than from ``@schema.parametrize()``:
its fixture-backed form (``schemathesis.pytest.from_fixture``) fails under
pytest 9.2, which no longer has the ``Node._nodeid`` it rewrites.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from itertools import chain

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import APIOperation, Case, GenerationMode
from schemathesis.core.result import Err
from schemathesis.specs.openapi.schemas import OpenApiSchema

from tests.support.worker import Worker

TOKEN = "fuzz-" + "t" * 24
AUTH = {"authorization": f"Bearer {TOKEN}"}
MAX_EXAMPLES = 30
FUZZ = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
# The worker's codes are what scripts match on: lowercase snake_case, every one.
STABLE_CODE = re.compile(r"^[a-z][a-z0-9_]*$")

# Cases sent, by (mode, operation): the end-of-run check wants every operation fuzzed.
SENT: Counter[tuple[str, str]] = Counter()


WORKER_ARGS = (
    "--token",
    TOKEN,
)  # the module's worker (tests/conftest.py)


@pytest.fixture(scope="module")
def api_schema(worker: Worker) -> OpenApiSchema:
    # Explicit, so no schemathesis.toml lying around changes the run; unsanitized, so a
    # failure's curl line shows the shm "key" it sent instead of "[Filtered]".
    config = schemathesis.Config.from_dict({"output": {"sanitization": {"enabled": False}}})
    return schemathesis.openapi.from_url(
        f"{worker.tcp_url}/openapi.json",
        config=config,
        timeout=30,
        headers={"authorization": f"Bearer {TOKEN}"},  # the schema is behind the token too
    )


def operations(schema: OpenApiSchema) -> list[APIOperation]:
    ops = []
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            pytest.fail(f"the worker's own schema is invalid: {result.err()}")
        ops.append(result.ok())
    return ops


def violable(operation: APIOperation) -> bool:
    """Whether any request can break ``operation``'s schema: a body, a query, header or
    cookie parameter, or a path parameter that is more than any string. (Hypothesis
    proves the rest unsatisfiable too, by drawing some hundreds of cases for each.)"""
    if len(operation.body) or any(True for _ in chain(operation.headers, operation.cookies,
                                                      operation.query)):  # fmt: skip
        return True
    return any(_constraints(param.definition.get("schema", {})) != {"type": "string"}
               for param in operation.path_parameters)  # fmt: skip


def _constraints(schema: dict[str, object]) -> dict[str, object]:
    return {key: value for key, value in schema.items() if key not in ("title", "description")}


def check_answer(case: Case, response: schemathesis.Response, worker: Worker) -> None:
    repro = case.as_curl_command(headers=AUTH, base_url=worker.tcp_url)
    status, body = response.status_code, response.content
    assert status < 500, f"{status} {body[:500]!r}\n{repro}"
    assert worker.proc.poll() is None, f"the worker died\n{repro}"
    if status < 400:
        return
    content_type = response.headers.get("content-type", [""])[0]
    assert content_type.split(";")[0] == "application/json", f"{status} as {content_type}\n{repro}"
    payload = json.loads(body)
    # Encode failures also carry their per-output results; validation errors a detail list.
    assert isinstance(payload, dict), f"{status} {payload!r}\n{repro}"
    assert isinstance(payload.get("error"), str) and payload["error"], f"{payload!r}\n{repro}"
    code = payload.get("code")
    assert isinstance(code, str) and STABLE_CODE.match(code), f"{status} {payload!r}\n{repro}"


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzz(
    mode: GenerationMode,
    api_schema: OpenApiSchema,
    worker: Worker,
) -> None:
    for operation in operations(api_schema):
        if mode is GenerationMode.NEGATIVE and not violable(operation):
            continue

        @FUZZ
        @given(case=operation.as_strategy(generation_mode=mode))
        def fuzz(case: Case) -> None:
            SENT[mode.value, case.operation.label] += 1
            # No shared session: each case on a fresh connection, independent of the last
            # (and kept-alive TCP answers from the worker come ~40 ms late: Nagle).
            response = case.call(base_url=worker.tcp_url, headers=AUTH, timeout=30)
            check_answer(case, response, worker)

        fuzz()  # (Unsatisfiable for an operation violable() let through fails the test)


def test_worker_survived(api_schema: OpenApiSchema, worker: Worker) -> None:
    ops = operations(api_schema)
    for mode in GenerationMode:
        wanted = {op.label for op in ops if mode is GenerationMode.POSITIVE or violable(op)}
        fuzzed = {label for (m, label), n in SENT.items() if m == mode.value and n}
        assert fuzzed == wanted, f"{mode} left unfuzzed: {sorted(wanted - fuzzed)}"
    assert worker.proc.poll() is None
    assert requests.get(f"{worker.tcp_url}/healthz", timeout=10).status_code == 200
    log = worker.log.read_text()
    assert "Traceback" not in log, log
    # No case named a source that exists, so every encode was refused: nothing made.
    assert list(worker.outputs.iterdir()) == []
