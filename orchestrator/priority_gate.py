"""PriorityGate: a worker's compute threads, taken by request priority.

A worker holds up to ``capacity`` requests but computes ``compute_threads`` of them at once;
the rest wait inside it. The daemon's queues order requests by priority, so this wait must
too: in arrival order, a request of high priority would wait behind every one of lower
priority the worker took before it (three at the defaults), at every stage.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio


@dataclass(order=True)
class _Waiter:
    rank: tuple[int, int]  # (-priority, arrival): the smallest goes in first
    granted: anyio.Event = field(compare=False, default_factory=anyio.Event)
    gone: bool = field(compare=False, default=False)  # cancelled while waiting


class PriorityGate:
    """At most ``slots`` holders at once; waiters go in by priority (higher first), then in
    the order they came."""

    def __init__(self, slots: int) -> None:
        self._free = slots
        self._waiters: list[_Waiter] = []
        self._arrivals = itertools.count()

    @asynccontextmanager
    async def slot(self, priority: int) -> AsyncIterator[None]:
        if self._free and not self._waiters:
            self._free -= 1
        else:
            waiter = _Waiter((-priority, next(self._arrivals)))
            heapq.heappush(self._waiters, waiter)
            try:
                await waiter.granted.wait()
            except BaseException:
                if waiter.granted.is_set():
                    self._release()  # handed the slot as it was cancelled: it goes to the next
                else:
                    waiter.gone = True  # skipped when its turn comes
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiters:
            waiter = heapq.heappop(self._waiters)
            if not waiter.gone:
                waiter.granted.set()  # the slot passes straight to it
                return
        self._free += 1
