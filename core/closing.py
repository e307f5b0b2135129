"""A context manager for things that hold a resource until ``close()``."""

from __future__ import annotations

from typing import Self


class Closing:
    """``with x:`` closes ``x`` at the end of the block, however it ends."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
