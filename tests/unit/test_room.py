"""Room: the daemon's idea of what a receiver takes in one hand-off (its general region, its
largest slot) is exactly what the receiver's pool can hold, for any pool and slot sizes (odd
ones included)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.handoffs import Room
from actors.links import Link
from transfer.pool import MemoryPool, PoolTooSmall


@settings(max_examples=150, deadline=None)
@given(slot_sizes=st.lists(st.integers(1, 3000), max_size=4), spare=st.integers(0, 3000))
def test_the_room_is_what_the_pool_can_hold(slot_sizes: list[int], spare: int) -> None:
    size = sum(slot_sizes) + len(slot_sizes) * 255 + spare + 1  # room for the slots' alignment
    pool = MemoryPool(size, slot_sizes=slot_sizes)
    link = Link(routing_id=b"r", instance="decoder-1", role="decoder", name="d", session="s",
                pool_base=pool.base, pool_size=size, work_address="ipc://x", joined_at=0.0, last_seen=0.0)
    room = Room.of(link, pool.slots)
    assert room == Room(pool.capacity, max(slot_sizes, default=0))
    fit = room.largest_fit
    if fit == pool.capacity and fit:
        block = pool.try_alloc(fit)  # the region takes it whole...
        assert block is not None
        pool.free(block)
    with pytest.raises(PoolTooSmall):  # ...and one byte more fits nowhere
        pool.try_alloc(pool.capacity + 1)


def test_a_slot_that_ends_off_the_alignment_leaves_less_region_than_its_end_suggests() -> None:
    """A 1,000-byte slot takes 1,024 bytes; the region after it is trimmed to whole units
    (the case an audit found: the daemon said 65,544 bytes where the pool holds 65,280)."""
    pool = MemoryPool(256 * 259 + 240, slot_sizes=[1000])
    link = Link(routing_id=b"r", instance="decoder-1", role="decoder", name="d", session="s",
                pool_base=pool.base, pool_size=pool.size, work_address="ipc://x", joined_at=0.0, last_seen=0.0)
    assert Room.of(link, pool.slots).region == pool.capacity == 65280
