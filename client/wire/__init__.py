"""framewire.client.wire: the request and response bodies, as pydantic models.

These are the models a caller may build or read: what an encode, a probe, a
stream session and the fd socket send and answer, the frame and audio sources
they name, and the limits the worker holds them to. Their one definition, with
the helpers both sides validate with, is ``framewire.core.wire``; the formats
are described in docs/api.md.
"""

import warnings

from framewire.core import wire as _core
from framewire.core.wire.public import *  # noqa: F403
from framewire.core.wire.public import __all__ as __all__

# Helpers this module exported before the models' definitions moved to framewire.core.wire:
# still found here, with a DeprecationWarning that says where they live now.
_MOVED = frozenset({
    "IPC_HANDLE_BYTES", "MAX_HANDLE_BYTES", "REGION_NAME", "Flag", "Int", "Number",
    "WireModel", "contiguous_strides", "error_code", "normalize_uuid", "refusal",
})  # fmt: skip


def __getattr__(name: str) -> object:
    if name in _MOVED:
        warnings.warn(
            f"framewire.client.wire.{name} is not part of the client's API: "
            f"import it from framewire.core.wire",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_core, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
