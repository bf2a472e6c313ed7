"""SlotBook: best-fit preallocated receive slots, each given back exactly once."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from actors.slots import Slot, SlotBook
from transfer.protocol import SlotInfo


def infos(*sizes: int) -> list[SlotInfo]:
    return [SlotInfo(slot_id=i, address=(1 << 20) + i * 4096, size=size) for i, size in enumerate(sizes)]


def book(*sizes: int, instance: str = "denoiser-1") -> SlotBook:
    b = SlotBook()
    b.add_instance(instance, infos(*sizes))
    return b


def test_take_picks_the_smallest_slot_that_fits() -> None:
    b = book(4096, 1024, 2048)
    taken = b.take("denoiser-1", 1500)
    assert taken is not None and taken.size == 2048


def test_take_an_exact_fit() -> None:
    b = book(4096, 1024)
    taken = b.take("denoiser-1", 1024)
    assert taken is not None and taken.size == 1024


def test_take_nothing_fits() -> None:
    b = book(1024, 2048)
    assert b.take("denoiser-1", 2049) is None
    assert b.counts("denoiser-1") == (2, 2)


def test_take_from_unknown_instance() -> None:
    assert SlotBook().take("nobody", 1) is None


def test_take_when_every_slot_is_taken() -> None:
    b = book(1024)
    assert b.take("denoiser-1", 1) is not None
    assert b.take("denoiser-1", 1) is None


def test_slot_keeps_its_true_size_after_recycling() -> None:
    """A slot taken for a small payload goes back with its full size, not the payload's."""
    b = book(4096)
    small = b.take("denoiser-1", 10)
    assert small is not None
    b.recycle(small)
    big = b.take("denoiser-1", 4096)
    assert big == small and big.size == 4096


def test_recycle_twice_raises() -> None:
    b = book(1024, 2048)
    s = b.take("denoiser-1", 1)
    assert s is not None
    b.recycle(s)
    with pytest.raises(RuntimeError, match="recycled twice"):
        b.recycle(s)


def test_recycle_a_slot_never_taken_raises() -> None:
    b = book(1024)
    with pytest.raises(RuntimeError, match="recycled twice"):
        b.recycle(Slot("denoiser-1", 0, 1 << 20, 1024))


def test_recycle_of_a_removed_instance_is_dropped() -> None:
    b = book(1024)
    s = b.take("denoiser-1", 1)
    assert s is not None
    b.remove_instance("denoiser-1")
    b.recycle(s)
    assert b.counts("denoiser-1") == (0, 0)


def test_recycle_of_a_replaced_instance_is_dropped() -> None:
    """A slot from before the instance re-registered (same id, new memory) is not reinstated."""
    b = book(1024)
    old = b.take("denoiser-1", 1)
    assert old is not None
    b.add_instance("denoiser-1", [SlotInfo(slot_id=0, address=7 << 20, size=1024)])
    fresh = b.take("denoiser-1", 1)
    b.recycle(old)
    assert fresh is not None and fresh.address == 7 << 20
    assert b.counts("denoiser-1") == (0, 1)


def test_counts_track_free_and_total() -> None:
    b = book(1024, 1024, 4096)
    assert b.counts("denoiser-1") == (3, 3)
    b.take("denoiser-1", 1)
    assert b.counts("denoiser-1") == (2, 3)
    assert b.counts("unknown") == (0, 0)


def test_instances_are_booked_apart() -> None:
    b = book(1024, instance="denoiser-1")
    b.add_instance("decoder-2", infos(1024))
    taken = b.take("decoder-2", 1)
    assert taken is not None and taken.instance == "decoder-2"
    assert b.counts("denoiser-1") == (1, 1)


class SlotBookMachine(RuleBasedStateMachine):
    """Random take/recycle/add/remove: free + taken == total, and no slot is out twice.

    Instance names are never reused, as in the negotiator (``role-N`` from a counter).
    """

    taken = Bundle("taken")
    instances = Bundle("instances")

    def __init__(self) -> None:
        super().__init__()
        self.book = SlotBook()
        self.out: dict[str, set[int]] = {}  # live instance -> slot ids held by callers
        self.sizes: dict[str, dict[int, int]] = {}
        self.next_id = 0

    @rule(target=instances, sizes=st.lists(st.integers(1, 64), max_size=5))
    def add_instance(self, sizes: list[int]) -> str:
        self.next_id += 1
        instance = f"denoiser-{self.next_id}"
        self.book.add_instance(instance, infos(*sizes))
        self.out[instance] = set()
        self.sizes[instance] = dict(enumerate(sizes))
        return instance

    @rule(instance=instances)
    def remove_instance(self, instance: str) -> None:
        self.book.remove_instance(instance)
        self.out.pop(instance, None)
        self.sizes.pop(instance, None)

    @rule(target=taken, instance=instances, nbytes=st.integers(0, 70))
    def take(self, instance: str, nbytes: int) -> Slot | None:
        slot = self.book.take(instance, nbytes)
        if instance not in self.sizes:
            assert slot is None, "took a slot of a removed instance"
            return None
        sizes = self.sizes[instance]
        fitting = [size for sid, size in sizes.items() if sid not in self.out[instance] and size >= nbytes]
        if slot is None:
            assert not fitting
            return None
        assert slot.slot_id not in self.out[instance], "slot handed out twice"
        assert slot.size == min(fitting), "not the best fit"
        assert slot.size == sizes[slot.slot_id], "slot lost its true size"
        self.out[instance].add(slot.slot_id)
        return slot

    @rule(slot=consumes(taken))
    def recycle(self, slot: Slot | None) -> None:
        if slot is None:
            return
        self.book.recycle(slot)
        self.out.get(slot.instance, set()).discard(slot.slot_id)

    @invariant()
    def free_plus_taken_is_total(self) -> None:
        for instance, sizes in self.sizes.items():
            free, total = self.book.counts(instance)
            assert total == len(sizes)
            assert free + len(self.out[instance]) == total


TestSlotBookMachine = SlotBookMachine.TestCase
TestSlotBookMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
