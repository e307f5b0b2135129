"""Real parts a test needs (a browser, hls.js, Prometheus, podman, root, namespaces, another
Python): where one cannot be had, the test skips, except in CI (``CI=true``), where it
fails with the reason: a part CI cannot install must not pass as a skip."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def unavailable(why: str) -> NoReturn:
    """Skip (elsewhere) or fail (in CI) the running test: ``why`` says what is missing."""
    if IN_CI:
        pytest.fail(f"needed in CI, and not to be had: {why}", pytrace=False)
    pytest.skip(why)


# Tests that act as other uids: they need root (CI runs as root).
needs_root = pytest.mark.usefixtures("as_root")
