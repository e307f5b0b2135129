"""Every request the Python client sends fails as a dead worker's would (connection
refused): a test that says it goes through the worker must then fail, not pass on the
client's local fallback."""

from __future__ import annotations

from typing import Any

import httpx


def _refused(self: Any, call: Any) -> Any:
    raise httpx.ConnectError("mutant: the worker is dead")


async def _refused_async(self: Any, call: Any) -> Any:
    raise httpx.ConnectError("mutant: the worker is dead")


def apply() -> None:
    from framewire.client import _http

    _http.Client._request = _refused  # type: ignore[method-assign]
    _http.AsyncClient._request = _refused_async  # type: ignore[method-assign]
