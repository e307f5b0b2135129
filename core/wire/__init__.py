"""The wire models: the one definition of every request and response body.

The worker validates requests with these models and the client builds them, so
the two sides cannot drift. This is the whole set, with the helpers both sides
validate with; ``framewire.client.wire`` is the part a user sees
(:mod:`framewire.core.wire.public`). Nothing here imports torch. The formats
themselves are described in docs/api.md.
"""

from framewire.core.wire._fdsocket import REGION_NAME, FdTake
from framewire.core.wire._messages import error_code, profile_misfit, refusal
from framewire.core.wire._sources import (
    IPC_HANDLE_BYTES,
    MAX_HANDLE_BYTES,
    Flag,
    Int,
    Number,
    WireModel,
    contiguous_strides,
    normalize_uuid,
)
from framewire.core.wire._streams import StreamStateName
from framewire.core.wire.public import *  # noqa: F403
from framewire.core.wire.public import __all__ as __all__

__all__ += (
    "IPC_HANDLE_BYTES",
    "MAX_HANDLE_BYTES",
    "REGION_NAME",
    "FdTake",
    "Flag",
    "Int",
    "Number",
    "StreamStateName",
    "WireModel",
    "contiguous_strides",
    "error_code",
    "normalize_uuid",
    "profile_misfit",
    "refusal",
)
