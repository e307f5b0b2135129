"""POSIX shm segments for tests, and the wire descriptors of what is in them."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import torch


def shm_source(key: str, clip: torch.Tensor, layout: str = "CTHW", **over: object) -> dict:
    """The wire descriptor of ``clip`` written whole at offset 0 of segment ``key``."""
    src = {
        "kind": "shm",
        "key": key,
        "offset": 0,
        "byte_size": clip.numel() * clip.element_size(),
        "dtype": str(clip.dtype).removeprefix("torch."),
        "shape": list(clip.shape),
        "layout": layout,
    }
    return src | over


def raw_bytes(clip: torch.Tensor) -> bytes:
    return clip.contiguous().view(torch.uint8).numpy().tobytes()


class Segments:
    """The segments one test makes (``/framewire-test-<pid>-…`` unless told); all unlinked
    after it. The pid tells this test process's segments from those of the suite's others."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def write(self, data: bytes | torch.Tensor, prefix: str = "/framewire-test-") -> str:
        """A new segment holding ``data`` (a tensor's raw bytes); returns its key."""
        key = f"{prefix}{os.getpid()}-{secrets.token_hex(6)}"
        raw = raw_bytes(data) if isinstance(data, torch.Tensor) else data
        Path(f"/dev/shm{key}").write_bytes(raw)
        self.keys.append(key)
        return key

    def source(self, clip: torch.Tensor, layout: str = "CTHW", **over: object) -> dict[str, Any]:
        """A new segment holding ``clip``, as the shm source that describes it."""
        return shm_source(self.write(clip), clip, layout, **over)

    def names(self) -> set[str]:
        """The /dev/shm names of the segments made so far."""
        return {key.lstrip("/") for key in self.keys}

    def remove(self) -> None:
        for key in self.keys:
            Path(f"/dev/shm{key}").unlink(missing_ok=True)
        self.keys.clear()
