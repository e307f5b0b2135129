"""A worker's address that misbehaves: an HTTP proxy on a Unix socket, in front of a real
worker, that passes every request on except those of one route, which it

- ``silent``: takes and never answers (until the proxy stops);
- ``slow``: answers ``delay_s`` late;
- ``lying``: answers as the worker did, with the output gone from its path (a file
  removed) or with another sha256 (an output to memory);
- ``hostile``: answers 409 with a message and a code made to forge lines in a log
  (newlines, escapes, the caller's own token);
- ``older``: refuses a body naming a field in ``fields`` (400 ``bad_request``,
  "Extra inputs are not permitted") as a worker older than the field does.

It runs uvicorn in a thread of the test process, on its own event loop; the fd socket is
the worker's own (the proxy speaks HTTP only).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

KINDS = ("silent", "slow", "lying", "hostile", "older")
FORGED = "framewire: FORGED LINE"


def hostile_message(token: str) -> str:
    """A message a worker could send to forge log lines and show a token."""
    return f"refused\n{FORGED}\r\x1b[31mred\u2028{FORGED} token={token}\x00"


@dataclass(frozen=True)
class Fault:
    kind: str
    route: str  # a regular expression on "METHOD /path"
    delay_s: float = 0.0
    fields: tuple[str, ...] = ()  # ``older``: the body fields it does not know


class Misbehaving:
    """The proxy, as a context manager; ``url`` is what a client is given."""

    def __init__(self, worker_uds: Path, root: Path, fault: Fault):
        if fault.kind not in KINDS:
            raise ValueError(f"no fault {fault.kind!r}")
        self.fault = fault
        self.uds = root / "misbehaving.sock"
        self.hits = 0
        self.refused = 0  # ``older``: bodies refused for a field it does not know
        self._worker_uds = worker_uds
        self._route = re.compile(fault.route)
        self._released: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http: httpx.AsyncClient | None = None
        config = uvicorn.Config(
            self._app,
            uds=str(self.uds),
            log_level="warning",
            access_log=False,
            lifespan="on",
            interface="asgi3",
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="misbehaving", daemon=True)

    @property
    def url(self) -> str:
        return f"unix://{self.uds}"

    def __enter__(self) -> Misbehaving:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the misbehaving proxy did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        loop = self._loop
        if loop is not None and self._released is not None:
            loop.call_soon_threadsafe(self._released.set)
        self._server.should_exit = True
        self._thread.join(timeout=30)

    async def _app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        matched = self._route.fullmatch(f"{scope['method']} {scope['path']}") is not None
        if matched:
            self.hits += 1
        if matched and self.fault.kind == "silent":
            assert self._released is not None
            await self._released.wait()
            return
        if matched and self.fault.kind == "slow":
            await asyncio.sleep(self.fault.delay_s)
        if matched and self.fault.kind == "hostile":
            token = headers.get("authorization", "").removeprefix("Bearer ")
            answer = {"error": hostile_message(token), "code": f"bad\n{FORGED}"}
            await self._answer(send, 409, [], json.dumps(answer).encode())
            return
        if matched and self.fault.kind == "older":
            unknown = [f for f in self.fault.fields if f in json.loads(body or b"{}")]
            if unknown:
                self.refused += 1
                refusal = f"{unknown[0]}: Extra inputs are not permitted"
                answer = {"error": refusal, "code": "bad_request"}
                await self._answer(send, 400, [], json.dumps(answer).encode())
                return
        assert self._http is not None
        query = scope.get("query_string", b"").decode()
        forwarded = await self._http.request(
            scope["method"],
            scope["path"] + (f"?{query}" if query else ""),
            content=body,
            headers={k: v for k, v in headers.items() if k not in ("host", "content-length")},
        )
        content = forwarded.content
        if matched and self.fault.kind == "lying" and forwarded.is_success:
            content = json.dumps(_lie(forwarded.json())).encode()
        kept = [
            (k, v)
            for k, v in forwarded.headers.items()
            if k.lower() not in ("content-length", "transfer-encoding", "content-encoding")
        ]
        await self._answer(send, forwarded.status_code, kept, content)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._loop = asyncio.get_running_loop()
                self._released = asyncio.Event()
                transport = httpx.AsyncHTTPTransport(uds=str(self._worker_uds))
                self._http = httpx.AsyncClient(
                    base_url="http://framewire", transport=transport, timeout=120
                )
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._http is not None:
                    await self._http.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    @staticmethod
    async def _answer(send: Any, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        raw = [(k.encode(), v.encode()) for k, v in headers]
        raw.append((b"content-length", str(len(body)).encode()))
        if not any(k.lower() == "content-type" for k, _ in headers):
            raw.append((b"content-type", b"application/json"))
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body})


def _lie(answer: Any) -> Any:
    """The worker's answer with each output it names gone from its path (a file) or with
    another sha256 (an output to memory)."""
    results = answer.get("outputs", [answer]) if isinstance(answer, dict) else []
    for result in results:
        path = result.get("path") if isinstance(result, dict) else None
        if not isinstance(path, str):
            continue
        if os.path.isabs(path) and os.path.exists(path):
            with contextlib.suppress(OSError):
                os.remove(path)
        else:
            result["sha256"] = "0" * 64
    return answer
