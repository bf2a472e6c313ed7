"""``RecentIds``: ids (or any hashable keys) seen in the last few moments, in a bounded amount of memory."""

from __future__ import annotations

from collections.abc import Hashable


class RecentIds:
    """Ids added in the last ``window_s``, at most ``most`` of them: adding past that forgets
    the oldest. Kept in the order they were added, which is the order they expire in."""

    def __init__(self, window_s: float, most: int) -> None:
        self._window_s = window_s
        self._most = most
        self._until: dict[Hashable, float] = {}

    def add(self, key: Hashable, now: float) -> None:
        self._until.pop(key, None)
        self._until[key] = now + self._window_s
        while self._until:
            oldest, until = next(iter(self._until.items()))
            if until > now and len(self._until) <= self._most:
                break
            del self._until[oldest]

    def __len__(self) -> int:
        return len(self._until)

    def holds(self, key: Hashable, now: float) -> bool:
        return self._until.get(key, 0.0) > now

    def take(self, key: Hashable, now: float) -> bool:
        """Whether ``key`` was added within the window; it is forgotten either way."""
        return self._until.pop(key, 0.0) > now
