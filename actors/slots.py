"""The preallocated receive slots of every receiver, as the negotiator books them.

A slot keeps the size its worker carved it with for its whole life. A hand-off takes the
smallest free slot that fits (best fit, by bisection over slots sorted by size), and a
slot goes back exactly once: recycling a slot that is already free is a bug and raises.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from transfer.protocol import SlotInfo


@dataclass(frozen=True, slots=True)
class Slot:
    instance: str
    slot_id: int
    address: int
    size: int


class SlotBook:
    """Free and total preallocated slots per receiver instance."""

    def __init__(self) -> None:
        # Per instance: free slots as (size, slot_id) sorted ascending, plus every slot.
        self._free: dict[str, list[tuple[int, int]]] = {}
        self._all: dict[str, dict[int, Slot]] = {}

    def add_instance(self, instance: str, slots: list[SlotInfo]) -> None:
        self._all[instance] = {s.slot_id: Slot(instance, s.slot_id, s.address, s.size) for s in slots}
        self._free[instance] = sorted((s.size, s.slot_id) for s in slots)

    def remove_instance(self, instance: str) -> None:
        self._all.pop(instance, None)
        self._free.pop(instance, None)

    def take(self, instance: str, nbytes: int) -> Slot | None:
        """The smallest free slot of ``instance`` holding at least ``nbytes``, now taken."""
        free = self._free.get(instance)
        if not free:
            return None
        index = bisect.bisect_left(free, (nbytes, -1))
        if index == len(free):
            return None
        _, slot_id = free.pop(index)
        return self._all[instance][slot_id]

    def recycle(self, slot: Slot) -> None:
        """Give ``slot`` back. A slot of an instance that has left is simply dropped."""
        free = self._free.get(slot.instance)
        if free is None or self._all[slot.instance].get(slot.slot_id) != slot:
            return
        entry = (slot.size, slot.slot_id)
        index = bisect.bisect_left(free, entry)
        if index < len(free) and free[index] == entry:
            raise RuntimeError(f"slot {slot.slot_id} of {slot.instance} recycled twice")
        free.insert(index, entry)

    def counts(self, instance: str) -> tuple[int, int]:
        """(free, total) preallocated slots of ``instance``."""
        return len(self._free.get(instance, ())), len(self._all.get(instance, ()))
