"""framewire.service: the worker process (HTTP API, encoder, decoder, CLI)."""

from framewire.client import __version__

__all__ = ["__version__"]
