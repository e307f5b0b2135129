"""The worker's HTTP application."""

from __future__ import annotations

from fastapi import FastAPI
from framewire.client import __version__

from .ffmpeg import ffmpeg_version, resolve_ffmpeg
from .settings import Settings


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    ffmpeg = resolve_ffmpeg(settings.ffmpeg)
    app = FastAPI(title="framewire", version=__version__)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/info")
    def info() -> dict[str, object]:
        return {"version": __version__, "ffmpeg": ffmpeg, "ffmpeg_version": ffmpeg_version(ffmpeg)}

    return app
