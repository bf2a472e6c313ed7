"""A worker's registered memory pool: one pinned-once region, carved into slots and blocks.

The whole region is registered with the transfer engine once at start (registration pins
memory on RDMA and costs time proportional to size), and every hand-off is sub-allocated
from it:

* preallocated receive slots, carved from the start of the region at construction and
  advertised to the daemon (the fast path: a sender can write without asking first);
* the rest is a general region, served first-fit from a sorted, coalescing free list
  (the slow path, and staged outputs waiting to be pushed).

Waiters are served strictly in FIFO order: a small request never overtakes a large one
queued before it, so a large hand-off cannot be starved by a stream of small ones.

All methods run on the owning event-loop thread, so nothing here takes a lock. Worker
threads may read and write through ``view()`` tensors, never call the allocator.
"""

from __future__ import annotations

import bisect
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio
import torch

from transfer.protocol import SlotInfo
from transfer.specs import ALIGNMENT, align_up


class PoolError(Exception):
    """Misuse of the pool (double free, unknown block) or a failed allocation."""


class PoolUnallocatable(Exception):
    """The machine cannot give a pool its memory: a setting's mistake, said in one line."""


def physical_memory() -> int:
    """This machine's memory in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class PoolTooSmall(PoolError):
    """The request is larger than the whole allocatable region: waiting cannot help."""


class PoolExhausted(PoolError):
    """The request did not fit before its deadline."""


@dataclass(frozen=True, slots=True)
class Block:
    """A reservation in the general region; ``size`` is the aligned size reserved."""

    offset: int
    size: int


@dataclass(eq=False, slots=True)
class _Waiter:
    # eq=False: the queue removes waiters by identity, two equal requests are distinct.
    need: int
    event: anyio.Event = field(default_factory=anyio.Event)
    block: Block | None = None


class MemoryPool:
    """Owns one contiguous CPU region: its prealloc slots, free list and waiter queue."""

    def __init__(self, size: int, *, slot_sizes: Sequence[int] = (), memory: torch.Tensor | None = None) -> None:
        """``memory``: a uint8 tensor of at least ``size`` bytes, aligned, to live in (shared
        memory, say); by default the pool allocates its own."""
        if size <= 0:
            raise ValueError(f"pool size must be positive, got {size}")
        if any(s <= 0 for s in slot_sizes):
            raise ValueError(f"slot sizes must be positive, got {list(slot_sizes)}")
        if memory is None:
            # Over-allocate so the region itself starts on an aligned address: offsets are then
            # aligned absolutely, not only relative to the base (torch's CPU allocator gives 64).
            try:
                raw = torch.empty(size + ALIGNMENT, dtype=torch.uint8)
            except RuntimeError as exc:  # torch's "can't allocate memory"
                raise PoolUnallocatable(f"a pool of {size} bytes cannot be allocated: {exc}") from None
            pad = -raw.data_ptr() % ALIGNMENT
            self.buffer = raw[pad : pad + size]
        else:
            if memory.dtype != torch.uint8 or memory.numel() < size or memory.data_ptr() % ALIGNMENT:
                raise ValueError(f"pool memory must be {size} aligned uint8 bytes at least")
            self.buffer = memory[:size]
        # Touch every page now, so the first transfer into the pool does not page-fault
        # (and so RDMA registration with location "*" can find the pages' NUMA node).
        self.buffer.zero_()
        self.base = self.buffer.data_ptr()
        self.size = size

        self.slots: list[SlotInfo] = []
        end = 0
        for slot_id, slot_size in enumerate(slot_sizes):
            self.slots.append(SlotInfo(slot_id=slot_id, address=self.base + end, size=slot_size))
            end += align_up(slot_size, ALIGNMENT)
        if end > size:
            raise ValueError(f"prealloc slots need {end} bytes (aligned), pool has {size}")

        # The general region, trimmed to whole alignment units so every block fits in it.
        self._start = end
        self._capacity = (size - end) // ALIGNMENT * ALIGNMENT
        # Sorted by offset, never two adjacent entries (coalesced on free).
        self._free: list[tuple[int, int]] = [(end, self._capacity)] if self._capacity else []
        self._allocated: dict[int, int] = {}  # offset -> reserved size
        self._waiters: deque[_Waiter] = deque()

    # ------------------------------------------------------------------ allocation

    def try_alloc(self, nbytes: int) -> Block | None:
        """Reserve now, or None if it does not fit now or others are already waiting."""
        need = self._need(nbytes)
        if self._waiters:  # never jump the queue
            return None
        return self._take(need)

    async def alloc(self, nbytes: int, *, timeout_s: float) -> Block:
        """Reserve, waiting in FIFO order up to ``timeout_s`` for frees to make room."""
        if (block := self.try_alloc(nbytes)) is not None:
            return block
        waiter = _Waiter(self._need(nbytes))
        self._waiters.append(waiter)
        try:
            with anyio.move_on_after(timeout_s):
                await waiter.event.wait()
            # A cancel that came after the grant, in the same loop turn (a free, then an
            # abort of the waiter's request), finds the wait already over and is delivered
            # at the next await: here, not after our caller has recorded the block.
            await anyio.lowlevel.checkpoint_if_cancelled()
        except BaseException:
            # Cancelled from outside. The block may have been granted in the same instant:
            # give it back rather than leak it.
            self._abandon(waiter)
            raise
        if waiter.block is None:
            self._abandon(waiter)
            raise PoolExhausted(
                f"no room for {nbytes} bytes within {timeout_s}s: {self.free_bytes} bytes free, "
                f"largest free segment {self.largest_free}, {self.waiters} waiting, "
                f"capacity {self._capacity}"
            )
        return waiter.block

    def free(self, block: Block) -> None:
        """Return a block, coalesce it with its neighbours, then serve waiters in order."""
        if self._allocated.get(block.offset) != block.size:
            raise PoolError(f"{block} is not allocated (double free or foreign block)")
        del self._allocated[block.offset]
        i = bisect.bisect_left(self._free, (block.offset, 0))
        offset, size = block.offset, block.size
        if i < len(self._free) and offset + size == self._free[i][0]:
            size += self._free.pop(i)[1]
        if i > 0 and (prev := self._free[i - 1])[0] + prev[1] == offset:
            self._free[i - 1] = (prev[0], prev[1] + size)
        else:
            self._free.insert(i, (offset, size))
        self._serve()

    def _need(self, nbytes: int) -> int:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        # A zero-byte request still gets a real block: callers free what they alloc.
        need = max(align_up(nbytes, ALIGNMENT), ALIGNMENT)
        if need > self._capacity:
            raise PoolTooSmall(
                f"{nbytes} bytes can never fit: the allocatable region is {self._capacity} bytes "
                f"(pool {self.size}, prealloc slots {self._start})"
            )
        return need

    def _take(self, need: int) -> Block | None:
        for i, (offset, size) in enumerate(self._free):
            if size >= need:
                if size == need:
                    del self._free[i]
                else:
                    self._free[i] = (offset + need, size - need)
                self._allocated[offset] = need
                return Block(offset, need)
        return None

    def _serve(self) -> None:
        # Strict FIFO: stop at the first waiter that does not fit, even if later ones would.
        while self._waiters:
            block = self._take(self._waiters[0].need)
            if block is None:
                return
            waiter = self._waiters.popleft()
            waiter.block = block
            waiter.event.set()

    def _abandon(self, waiter: _Waiter) -> None:
        if waiter.block is not None:
            self.free(waiter.block)  # also serves the queue
        else:
            self._waiters.remove(waiter)
            self._serve()  # it may have been the head holding others back

    # ------------------------------------------------------------------ addressing

    def view(self, block: Block) -> torch.Tensor:
        return self.buffer[block.offset : block.offset + block.size]

    def address(self, block: Block) -> int:
        return self.base + block.offset

    def view_at(self, address: int, nbytes: int) -> torch.Tensor:
        """The bytes at an absolute address, as announced to (or by) a peer."""
        offset = address - self.base
        if nbytes < 0 or offset < 0 or offset + nbytes > self.size:
            raise ValueError(
                f"[{address:#x}, +{nbytes}) is outside the pool [{self.base:#x}, +{self.size})"
            )
        return self.buffer[offset : offset + nbytes]

    # ------------------------------------------------------------------ stats

    @property
    def capacity(self) -> int:
        """Bytes of the general region (the pool minus slots and the alignment tail)."""
        return self._capacity

    @property
    def free_bytes(self) -> int:
        return sum(size for _, size in self._free)

    @property
    def largest_free(self) -> int:
        return max((size for _, size in self._free), default=0)

    @property
    def waiters(self) -> int:
        return len(self._waiters)

    @property
    def allocated_blocks(self) -> int:
        return len(self._allocated)
