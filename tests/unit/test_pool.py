"""MemoryPool: alignment, coalescing, slots, fair waiters, bounds."""

from __future__ import annotations

import anyio
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from transfer.pool import Block, MemoryPool, PoolError, PoolExhausted, PoolTooSmall, PoolUnallocatable

A = 256  # default alignment


def check_invariants(pool: MemoryPool) -> None:
    """Free list sorted and coalesced; free and allocated tile the region without overlap.

    Reads the pool's private lists: these are the invariants its public numbers rest on.
    """
    spans = sorted([*pool._free, *pool._allocated.items()])
    cursor = pool._start
    for offset, size in spans:
        assert offset % A == 0 and size % A == 0 and size > 0
        assert offset == cursor, "gap or overlap"
        cursor = offset + size
    assert sum(size for _, size in spans) == pool.capacity
    for (o1, s1), (o2, _) in zip(pool._free, pool._free[1:]):
        assert o1 + s1 < o2, "adjacent free segments were not coalesced"
    assert pool.base % A == 0


# --------------------------------------------------------------------------- pure


def test_offsets_and_addresses_are_aligned() -> None:
    pool = MemoryPool(64 * A, slot_sizes=(100, 1))
    assert pool.base % A == 0
    blocks = [pool.try_alloc(n) for n in (1, 255, 256, 257, 1000)]
    assert all(b is not None and b.offset % A == 0 and pool.address(b) % A == 0 for b in blocks)
    assert [b.size for b in blocks if b] == [256, 256, 256, 512, 1024]


def test_zero_bytes_still_gets_a_block() -> None:
    pool = MemoryPool(4 * A)
    block = pool.try_alloc(0)
    assert block == Block(0, A)
    pool.free(block)
    assert pool.free_bytes == pool.capacity


def test_slots_keep_true_sizes_and_precede_the_region() -> None:
    pool = MemoryPool(16 * A, slot_sizes=(1000, 3 * A))
    assert [(s.slot_id, s.size) for s in pool.slots] == [(0, 1000), (1, 3 * A)]
    assert pool.slots[0].address == pool.base
    assert pool.slots[1].address == pool.base + 4 * A  # 1000 rounded up to 1024
    assert pool.view_at(pool.slots[1].address, pool.slots[1].size).data_ptr() == pool.slots[1].address
    assert pool.capacity == 16 * A - 7 * A
    first = pool.try_alloc(1)
    assert first is not None and first.offset == 7 * A


def test_slots_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="slots"):
        MemoryPool(4 * A, slot_sizes=(2 * A, 2 * A + 1))


def test_unaligned_tail_is_not_allocatable() -> None:
    pool = MemoryPool(4 * A + 100)
    assert pool.capacity == 4 * A
    with pytest.raises(PoolTooSmall):
        pool.try_alloc(4 * A + 1)


def test_freed_neighbours_coalesce() -> None:
    pool = MemoryPool(8 * A)
    a, b, c, d = (pool.try_alloc(2 * A) for _ in range(4))
    assert a and b and c and d
    pool.free(a)
    pool.free(c)
    assert pool.largest_free == 2 * A and pool.free_bytes == 4 * A
    pool.free(b)  # joins a and c
    assert pool.largest_free == 6 * A
    assert pool.try_alloc(6 * A) == Block(0, 6 * A)
    check_invariants(pool)


def test_too_large_is_refused_at_once() -> None:
    pool = MemoryPool(8 * A, slot_sizes=(4 * A,))
    with pytest.raises(PoolTooSmall, match="1025 bytes"):
        pool.try_alloc(4 * A + 1)


async def test_too_large_does_not_wait() -> None:
    pool = MemoryPool(8 * A)
    with anyio.fail_after(5):
        with pytest.raises(PoolTooSmall):
            await pool.alloc(9 * A, timeout_s=60)
    assert pool.waiters == 0


def test_double_free_and_foreign_block_raise() -> None:
    pool = MemoryPool(8 * A)
    block = pool.try_alloc(A)
    assert block is not None
    pool.free(block)
    with pytest.raises(PoolError, match="not allocated"):
        pool.free(block)
    held = pool.try_alloc(2 * A)
    assert held is not None
    with pytest.raises(PoolError):
        pool.free(Block(held.offset, A))  # right offset, wrong size
    with pytest.raises(PoolError):
        pool.free(Block(held.offset + A, A))  # inside a block, not its start


def test_view_at_bounds() -> None:
    pool = MemoryPool(4 * A)
    pool.view_at(pool.base, 4 * A)[:] = 7
    assert pool.view_at(pool.base + A, 3 * A).numel() == 3 * A
    for address, nbytes in [(pool.base - 1, 1), (pool.base + 3 * A, A + 1), (pool.base, -1)]:
        with pytest.raises(ValueError, match="outside the pool"):
            pool.view_at(address, nbytes)


def test_views_share_the_buffer() -> None:
    pool = MemoryPool(4 * A, slot_sizes=(10,))
    block = pool.try_alloc(5)
    assert block is not None
    pool.view(block)[:5] = torch.arange(5, dtype=torch.uint8)
    assert pool.view_at(pool.address(block), 5).tolist() == [0, 1, 2, 3, 4]


# --------------------------------------------------------------------------- property


class PoolMachine(RuleBasedStateMachine):
    """Random alloc/free sequences keep the free list and blocks tiling the region."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = MemoryPool(64 * A + 17, slot_sizes=(300, A))
        self.held: list[Block] = []

    @rule(nbytes=st.integers(0, 20 * A))
    def alloc(self, nbytes: int) -> None:
        need = max(-(-nbytes // A) * A, A)
        block = self.pool.try_alloc(nbytes)
        if block is None:
            assert self.pool.largest_free < need  # first fit never misses a hole that fits
        else:
            assert block.size == need
            self.held.append(block)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.pool.free(self.held.pop(data.draw(st.integers(0, len(self.held) - 1))))

    @invariant()
    def tiles(self) -> None:
        check_invariants(self.pool)
        assert self.pool.allocated_blocks == len(self.held)

    def teardown(self) -> None:
        for block in self.held:
            self.pool.free(block)
        assert self.pool.free_bytes == self.pool.largest_free == self.pool.capacity


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# --------------------------------------------------------------------------- waiting


async def test_deadline_raises_exhausted_and_leaves_queue() -> None:
    pool = MemoryPool(4 * A)
    assert pool.try_alloc(4 * A) is not None
    with anyio.fail_after(5):
        with pytest.raises(PoolExhausted, match=r"256 bytes within 0.05s: 0 bytes free"):
            await pool.alloc(A, timeout_s=0.05)
    assert pool.waiters == 0


async def test_waiter_is_served_when_space_frees() -> None:
    pool = MemoryPool(4 * A)
    full = pool.try_alloc(4 * A)
    assert full is not None
    got: list[Block] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_record, pool, 2 * A, got)
            await anyio.wait_all_tasks_blocked()
            assert pool.waiters == 1
            pool.free(full)
    assert got == [Block(0, 2 * A)]


async def _record(pool: MemoryPool, nbytes: int, got: list[Block], timeout_s: float = 5) -> None:
    got.append(await pool.alloc(nbytes, timeout_s=timeout_s))


async def test_small_waiter_never_overtakes_large_one() -> None:
    """Frees that would fit a later small request still serve the earlier large one first."""
    pool = MemoryPool(8 * A)
    a, b, c, d = (pool.try_alloc(2 * A) for _ in range(4))
    assert a and b and c and d
    got: list[Block] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_record, pool, 4 * A, got)  # large, first
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(_record, pool, A, got)  # small, later
            await anyio.wait_all_tasks_blocked()
            pool.free(a)  # small would fit now...
            assert pool.try_alloc(A) is None  # ...and nobody may jump the queue
            await anyio.wait_all_tasks_blocked()
            assert got == [] and pool.waiters == 2
            pool.free(c)  # 2+2 free but split: large still cannot fit
            await anyio.wait_all_tasks_blocked()
            assert got == []
            pool.free(b)  # a+b+c coalesce: large first, then small behind it
    assert got == [Block(0, 4 * A), Block(4 * A, A)]
    check_invariants(pool)


async def test_timed_out_head_lets_the_next_waiter_in() -> None:
    pool = MemoryPool(8 * A)
    assert pool.try_alloc(6 * A) is not None
    got: list[Block] = []
    timed_out: list[bool] = []

    async def head() -> None:
        with pytest.raises(PoolExhausted):
            await pool.alloc(4 * A, timeout_s=0.05)
        timed_out.append(True)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(head)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(_record, pool, A, got)  # fits, but queued behind the head
            await anyio.wait_all_tasks_blocked()
            assert got == [] and pool.waiters == 2
    assert timed_out == [True] and got == [Block(6 * A, A)]


async def test_cancelled_waiter_leaves_the_queue() -> None:
    pool = MemoryPool(4 * A)
    full = pool.try_alloc(4 * A)
    assert full is not None
    got: list[Block] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_record, pool, 4 * A, got)
            await anyio.wait_all_tasks_blocked()
            assert pool.waiters == 1
            tg.cancel_scope.cancel()
    assert pool.waiters == 0 and got == []
    pool.free(full)
    assert pool.try_alloc(4 * A) is not None


@pytest.mark.parametrize("cancel_first", [True, False], ids=["cancel, then free", "free, then cancel"])
async def test_block_granted_at_the_moment_of_cancel_is_returned(cancel_first: bool) -> None:
    """Free grants the waiter a block and the waiter is cancelled in the same tick, in
    either order: it wakes up to the cancellation (its wait may be over already, the cancel
    must still reach it) and gives the block back."""
    pool = MemoryPool(4 * A)
    full = pool.try_alloc(4 * A)
    assert full is not None
    got: list[Block] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_record, pool, 2 * A, got)
            await anyio.wait_all_tasks_blocked()
            if cancel_first:
                tg.cancel_scope.cancel()
                pool.free(full)
                assert pool.allocated_blocks == 1 and pool.waiters == 0  # granted all the same
            else:
                pool.free(full)
                tg.cancel_scope.cancel()
    assert got == []
    assert pool.allocated_blocks == 0 and pool.free_bytes == pool.capacity


def test_a_pool_the_machine_cannot_allocate_says_so_as_a_setting_s_mistake() -> None:
    """Not torch's RuntimeError, which a worker's start would report as a crash."""
    with pytest.raises(PoolUnallocatable, match=f"a pool of {1 << 50} bytes cannot be allocated"):
        MemoryPool(1 << 50)
