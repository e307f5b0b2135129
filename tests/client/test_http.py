"""Client and AsyncClient are twins: the same public methods, signatures and docstrings."""

from __future__ import annotations

import asyncio
import inspect

import httpx
import numpy as np
import pytest
from framewire.client import AsyncClient, Client

# What only the async twin spells differently: closing, and its context manager.
OWN = {"close", "aclose", "__enter__", "__exit__", "__aenter__", "__aexit__"}
# Plain functions in both twins: they make a writer (whose own twins are in test_stream).
MAKERS = {"open_video"}
NO_FD = "/nonexistent/fd.sock"  # a named fd socket nobody serves: host frames go as shm


def public(cls: type) -> dict[str, object]:
    return {
        name: member
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_") and name not in OWN
    }


def test_the_twins_have_the_same_methods_signatures_and_docstrings():
    sync, coro = public(Client), public(AsyncClient)
    assert sorted(sync) == sorted(coro)
    assert {"info", "probe", "save_videos", "save_video", "open_video", "decode_reference"} <= set(
        sync
    )
    for name in sync:
        signatures = [inspect.signature(f[name]) for f in (sync, coro)]
        if name in MAKERS:  # each returns its own twin writer
            signatures = [s.replace(return_annotation=None) for s in signatures]
        assert signatures[0] == signatures[1], name
        assert inspect.iscoroutinefunction(coro[name]) == (name not in MAKERS), name
        assert not inspect.iscoroutinefunction(sync[name]), f"Client.{name} is async"
        assert sync[name].__doc__, f"Client.{name} has no docstring"
        assert inspect.getdoc(sync[name]) == inspect.getdoc(coro[name]), name
    assert inspect.signature(Client.__init__) == inspect.signature(AsyncClient.__init__)


def test_the_twins_build_the_same_requests(monkeypatch):
    """One base builds every request: the bodies each twin would send are the same."""
    sent: list[tuple[str, str, object]] = []

    class Answered(Exception):
        pass

    def capture(self, method, path, json=None, timeout=None):  # either twin's transport
        if path == "/v1/info":  # asked first: the fd socket is checked against the worker
            return httpx.Response(200, json={"instance": "w"}, request=httpx.Request(method, path))
        sent.append((method, path, json))
        raise Answered

    async def capture_async(self, method, path, json=None, timeout=None):
        return capture(self, method, path, json, timeout)

    monkeypatch.setattr("httpx.Client.request", capture)
    monkeypatch.setattr("httpx.AsyncClient.request", capture_async)
    frames = np.zeros((2, 16, 16, 3), np.uint8)
    with Client("unix:///nowhere.sock", fd_socket=NO_FD) as c, pytest.raises(Answered):
        c.save_video(frames, "a.mp4", fps=24, quality=7, threads=2)

    async def go() -> None:
        async with AsyncClient("unix:///nowhere.sock", fd_socket=NO_FD) as c:
            with pytest.raises(Answered):
                await c.save_video(frames, "a.mp4", fps=24, quality=7, threads=2)

    asyncio.run(go())
    (m1, p1, b1), (m2, p2, b2) = sent
    assert (m1, p1) == (m2, p2) == ("POST", "/v1/videos:encode")
    for body in (b1, b2):  # the shm key differs (a new segment each time); the rest does not
        body["outputs"][0]["source"].pop("key")
    assert b1 == b2


def test_tls_contexts_verify_and_only_an_https_client_loads_the_ca_bundle():
    """httpx loaded the CA bundle for each transport (20-40 ms of CPU): an https client
    shares one verifying context per process; a client of an http:// or unix:// worker,
    which speaks plain HTTP, gets one that verifies and trusts no certificate at all."""
    import ssl

    def context(client: Client | AsyncClient) -> ssl.SSLContext:
        return client._http._transport._pool._ssl_context

    async def async_context(url: str) -> ssl.SSLContext:
        async with AsyncClient(url, fd_socket=NO_FD) as c:
            return context(c)

    with Client("https://127.0.0.1:9") as a, Client("https://[::1]:9") as b:
        https = [context(a), context(b), asyncio.run(async_context("https://127.0.0.1:9"))]
    assert https[0] is https[1] is https[2]
    assert https[0].cert_store_stats()["x509_ca"] > 0  # the bundle, loaded once
    with Client("unix:///nowhere.sock", fd_socket=NO_FD) as c, Client("http://127.0.0.1:9") as d:
        plain = [context(c), context(d), asyncio.run(async_context("unix:///nowhere.sock"))]
    assert all(ctx.cert_store_stats()["x509_ca"] == 0 for ctx in plain)  # trusts nothing
    for ctx in https + plain:
        assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
