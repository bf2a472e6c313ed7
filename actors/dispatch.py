"""Dispatch policies: which instance of a pool gets the next job.

Each policy is told every change of an instance's free-slot count and answers ``pick``
among instances with a free slot, in O(1) or O(log n) of the number of instances; none
scans the pool. A retry names instances to ``avoid`` (those its failed attempt involved):
they are passed over while another instance has room, which costs a few more steps for
the few requests that are retries, and taken when none has.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Collection
from typing import Protocol


class DispatchPolicy(Protocol):
    def update(self, instance: str, free: int) -> None:
        """``instance`` now has ``free`` free slots (0 makes it unpickable)."""

    def remove(self, instance: str) -> None:
        """``instance`` left the pool."""

    def pick(self, avoid: Collection[str] = ()) -> str | None:
        """An instance with a free slot, one not in ``avoid`` if there is one, or None.
        Does not change any count."""

    def has_room(self) -> bool:
        """Whether any instance has a free slot, in O(1); unlike ``pick``, it moves no turn."""


class FreeCounts:
    """Every policy's record of each instance's free slots, with how many have any."""

    def __init__(self) -> None:
        self._free: dict[str, int] = {}
        self._with_room = 0

    def _set_free(self, instance: str, free: int) -> None:
        self._with_room += (free > 0) - (self._free.get(instance, 0) > 0)
        self._free[instance] = free

    def _forget(self, instance: str) -> None:
        self._with_room -= self._free.pop(instance, 0) > 0

    def has_room(self) -> bool:
        return self._with_room > 0


class RoundRobin(FreeCounts):
    """Instances with free slots take turns: a ring that rotates on every pick."""

    def __init__(self) -> None:
        super().__init__()
        self._ring: deque[str] = deque()
        self._in_ring: set[str] = set()

    def update(self, instance: str, free: int) -> None:
        self._set_free(instance, free)
        if free > 0 and instance not in self._in_ring:
            self._in_ring.add(instance)
            self._ring.append(instance)

    def remove(self, instance: str) -> None:
        self._forget(instance)
        # Picks drop a departed instance's entry when they reach it; a pool with no work
        # while workers come and go would keep them all, and its next pick step over them.
        # Rebuilt once they outnumber the live instances: amortised O(1) per departure.
        if len(self._ring) > 2 * len(self._free) + 8:
            self._ring = deque(i for i in self._ring if self._free.get(i, 0) > 0)
            self._in_ring = set(self._ring)

    def pick(self, avoid: Collection[str] = ()) -> str | None:
        ring = self._ring
        passed: str | None = None
        looked = 0
        while looked < len(ring):
            instance = ring[0]
            if self._free.get(instance, 0) <= 0:
                ring.popleft()  # went full or left since it joined the ring; drop lazily
                self._in_ring.discard(instance)
                continue
            ring.rotate(-1)
            if instance not in avoid:
                return instance
            passed, looked = passed or instance, looked + 1
        return passed


class LeastLoaded(FreeCounts):
    """The instance with the most free slots (ties: the one that has waited longest).

    A heap with lazy invalidation: each update pushes a fresh entry and stale entries are
    skipped when they reach the top, so a pick is amortised O(log n).
    """

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[int, int, str]] = []
        self._latest: dict[str, int] = {}
        self._order = itertools.count()

    def update(self, instance: str, free: int) -> None:
        self._set_free(instance, free)
        self._latest[instance] = order = next(self._order)
        if free > 0:
            heapq.heappush(self._heap, (-free, order, instance))
        self._compact()

    def remove(self, instance: str) -> None:
        self._forget(instance)
        self._latest.pop(instance, None)

    def pick(self, avoid: Collection[str] = ()) -> str | None:
        heap = self._heap
        passed: list[tuple[int, int, str]] = []  # avoided, to go back on the heap
        found = None
        while heap:
            _, order, instance = heap[0]
            if self._latest.get(instance) != order:
                heapq.heappop(heap)  # stale
            elif instance in avoid:
                passed.append(heapq.heappop(heap))
            else:
                found = instance
                break
        for entry in passed:
            heapq.heappush(heap, entry)
        return found if found is not None or not passed else passed[0][2]

    def _compact(self) -> None:
        if len(self._heap) > 4 * len(self._free) + 64:
            self._heap = [(-free, self._latest[i], i) for i, free in self._free.items() if free > 0]
            heapq.heapify(self._heap)


class PowerOfTwo(FreeCounts):
    """Two random instances with free slots; the one with more free slots wins.

    Candidates live in a list with an index map, so add, remove and sample are O(1); a
    retry's sample skips the positions of the instances it avoids, O(k log k) for k of them.
    """

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__()
        self._rng = rng or random.Random()
        self._candidates: list[str] = []
        self._index: dict[str, int] = {}

    def update(self, instance: str, free: int) -> None:
        self._set_free(instance, free)
        if free > 0 and instance not in self._index:
            self._index[instance] = len(self._candidates)
            self._candidates.append(instance)
        elif free <= 0 and instance in self._index:
            self._drop(instance)

    def remove(self, instance: str) -> None:
        self._forget(instance)
        if instance in self._index:
            self._drop(instance)

    def pick(self, avoid: Collection[str] = ()) -> str | None:
        candidates = self._candidates
        if not candidates:
            return None
        # A retry's avoided instances sit at these positions; the rest are drawn from by
        # rank. A few avoided instances cost a few steps, whatever the pool's size.
        skipped = sorted(self._index[i] for i in avoid if i in self._index)
        if len(skipped) == len(candidates):
            skipped = []  # every candidate is avoided: any will do
        a, b = self._nth_allowed(skipped), self._nth_allowed(skipped)
        return a if self._free[a] >= self._free[b] else b

    def _nth_allowed(self, skipped: list[int]) -> str:
        """A uniformly drawn candidate whose position is not in ``skipped`` (sorted)."""
        position = self._rng.randrange(len(self._candidates) - len(skipped))
        for taken in skipped:
            if taken > position:
                break
            position += 1
        return self._candidates[position]

    def _drop(self, instance: str) -> None:
        position = self._index.pop(instance)
        last = self._candidates.pop()
        if last != instance:
            self._candidates[position] = last
            self._index[last] = position


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "power_of_two": PowerOfTwo}


def make_policy(name: str) -> DispatchPolicy:
    return POLICIES[name]()
