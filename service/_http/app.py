"""The worker's HTTP application: its routers, middleware and error handling, assembled."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from fastapi import FastAPI
from framewire.client import __version__
from framewire.service._http import errors, health, hls, live, streams, triton, videos
from framewire.service._http.middleware import (
    BearerAuth,
    BodyGuard,
    InstanceHeader,
    RequestCounter,
)
from framewire.service._ops.logs import RequestIds
from framewire.service._parts import Parts

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def create_app(parts: Parts, lifespan: Lifespan | None = None) -> FastAPI:
    """The app serving ``parts``; ``lifespan`` starts and stops them (the Worker's)."""
    settings = parts.settings
    app = FastAPI(title="framewire", version=__version__, lifespan=lifespan)
    app.state.parts = parts  # read by the routes' dependencies (deps.py) alone
    routers = (health.router, videos.router, streams.router, live.router, hls.router)
    for router in (*routers, triton.router):
        app.include_router(router)
    errors.install(app)
    app.add_middleware(errors.Unexpected)  # innermost: an unexpected error keeps the connection
    app.add_middleware(BodyGuard, limit=settings.max_body_bytes, idle_s=settings.idle_timeout_s)
    app.add_middleware(BearerAuth, token=settings.token, signed=parts.sessions.signer.allows)
    app.add_middleware(RequestCounter, metrics=parts.metrics)
    app.add_middleware(InstanceHeader, instance=parts.instance)
    app.add_middleware(RequestIds)  # outermost: whatever runs inside logs with the id
    return app
