"""One caller's part of a bound the worker keeps for all of its callers.

The waiting encodes, the open stream sessions and the audio held in memory are
each one bound for every caller. ``FRAMEWIRE_USER_SHARE`` lets one caller (a uid
other than root's and the worker's: ``Access.share_key``) take a part of each, so
that no user can fill one and have every rank refused: past it, ``429
user_share``. One ``Share`` per bound counts what each caller holds of it.
"""

from __future__ import annotations

from collections import Counter

from framewire.core.errors import Overloaded


class Share:
    """What each limited caller holds of the bound set by ``of`` (a setting's name), in
    ``unit``, and the most one may hold (``limit``; None: all of it)."""

    def __init__(self, limit: int | None, of: str, unit: str):
        self.limit = limit
        self.of = of
        self.unit = unit
        self._held: Counter[int] = Counter()

    def held(self, user: int | None) -> int:
        return 0 if user is None else self._held[user]

    def check(
        self, user: int | None, more: int, retry_after: float, held: int | None = None
    ) -> None:
        """Refuse ``more`` to ``user`` (None: not limited) past its share. ``held``: what
        it holds now, where the caller of this counts it itself."""
        if user is None or self.limit is None:
            return
        mine = self.held(user) if held is None else held
        if mine + more > self.limit:
            raise Overloaded(
                f"uid {user} holds {mine} {self.unit}; one caller may hold {self.limit} "
                f"(FRAMEWIRE_USER_SHARE of {self.of})",
                code="user_share",
                retry_after=retry_after,
            )

    def add(self, user: int | None, count: int) -> None:
        """``user`` holds ``count`` more (fewer, if negative)."""
        if user is None or not count:
            return
        self._held[user] += count
        if self._held[user] <= 0:
            del self._held[user]
