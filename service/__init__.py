"""framewire.service: the worker, and the encoder it runs, for use from Python.

``Worker(Settings(...)).run()`` is ``framewire serve``; ``Encoder`` encodes a frame
source in this process (what ``framewire encode --local`` does). Everything in a
module whose name starts with an underscore is private.

The names are loaded on first use: importing this package (which every
``framewire`` command does) must not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from framewire.client import __version__

if TYPE_CHECKING:
    from framewire.service._cli.main import main
    from framewire.service._encode.encoder import EncodeParams, Encoder
    from framewire.service._local import LocalEncoder
    from framewire.service._settings import Settings
    from framewire.service._sockets import AlreadyServed
    from framewire.service._sources.frames import FileSource, FrameSource, TensorSource, open_npy
    from framewire.service._worker import Worker

_WHERE = {
    "AlreadyServed": "framewire.service._sockets",
    "EncodeParams": "framewire.service._encode.encoder",
    "Encoder": "framewire.service._encode.encoder",
    "FileSource": "framewire.service._sources.frames",
    "FrameSource": "framewire.service._sources.frames",
    "LocalEncoder": "framewire.service._local",
    "Settings": "framewire.service._settings",
    "TensorSource": "framewire.service._sources.frames",
    "Worker": "framewire.service._worker",
    "main": "framewire.service._cli.main",
    "open_npy": "framewire.service._sources.frames",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'framewire.service' has no attribute {name!r}")


__all__ = [
    "AlreadyServed",
    "EncodeParams",
    "Encoder",
    "FileSource",
    "FrameSource",
    "LocalEncoder",
    "Settings",
    "TensorSource",
    "Worker",
    "__version__",
    "main",
    "open_npy",
]
