"""framewire.client: what an inference process imports to hand videos to the worker."""

from .errors import (
    BadRequest,
    Cancelled,
    Forbidden,
    FramewireError,
    MediaError,
    NotFound,
    Overloaded,
    Unavailable,
)

__version__ = "0.1.0"

__all__ = [
    "BadRequest",
    "Cancelled",
    "Forbidden",
    "FramewireError",
    "MediaError",
    "NotFound",
    "Overloaded",
    "Unavailable",
    "__version__",
]
