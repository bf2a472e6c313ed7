"""RequestMemory: what one worker holds for requests in its registered pool, and the
writes out of it (the worker's transfer path).

Three holdings, by request id: a stage's staged output (until pushed or aborted), the
block an ``Alloc`` made for an input on the slow path (until its ``Ready`` reads it, or
aborted), and a push in progress, whose staged block is freed only when the write ends:
memory a write is reading from is never handed out again underneath it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import anyio
import structlog
import torch

from orchestrator.stall_watch import StallWatch
from transfer import frames
from transfer.engine import Engine, TransferError, TransferInDoubt
from transfer.pool import Block, MemoryPool, PoolError
from transfer.protocol import Alloc, Allocated, AllocRejected, Push, Pushed, Ready, Staged, Via, brief
from transfer.shm import LocalCopyError, LocalWriter

# Copies up to this size run on the event loop (about 0.1 ms at memcpy speed): cheaper than
# the two thread hops a thread costs. Larger ones (same-host writes, staging an output) run
# on a thread, so the loop keeps answering allocs and pushes meanwhile.
INLINE_COPY_BYTES = 1 << 20
# How often the same-host writers look for receivers that exited, to unmap their pools.
UNMAP_GONE_S = 5.0


class RequestMemory:
    def __init__(self, pool: MemoryPool, engine: Engine, writers: tuple[LocalWriter, LocalWriter] | None, *,
                 alloc_timeout_s: float, push_quarantine_s: float, report: Callable[..., None]) -> None:
        self._pool = pool
        self._engine = engine
        self._writers = writers  # same-host copies: the loop's writer, and the one for writes on threads
        self._alloc_timeout_s = alloc_timeout_s
        self.push_quarantine_s = push_quarantine_s  # the daemon's, once registered (``registered``)
        self._report = report
        # Writes off the loop run on worker threads one at a time (a limiter of 1): a Mooncake
        # write blocks, sleeping, until the peer acks, and one writer per engine is what it
        # handles best.
        self._transfer = anyio.CapacityLimiter(1)
        self._staged: dict[str, Block] = {}
        self._allocs: dict[str, Block] = {}
        self._pushing: set[str] = set()
        # Pushes refused for a stall (``Pushed(stood_still)``), their outputs kept: the stalls
        # noticed by then. The Push sent again is stale only after a later stall.
        self._refused_after: dict[str, int] = {}
        # Until then a write we stopped waiting for may still be reading our memory or
        # landing in a peer's: the worker must not tell the daemon nothing of it can land.
        self.in_doubt_until = -math.inf
        self.log: Any = structlog.get_logger()  # the runtime's, bound to its registration
        # The registration's (its limit is half the daemon's heartbeat): a push read around
        # a stall of the worker's loop writes nothing (``_check_fresh``).
        self.stalls = StallWatch(math.inf)

    def registered(self, log: Any, heartbeat_s: float, push_quarantine_s: float) -> None:
        """Take on a registration's settings: the daemon's, not this worker's config copy's."""
        self.log = log
        # Half a heartbeat: the daemon takes a worker silent for two for dead (and what its
        # pushes were writing into for free), and its beats keep coming over shorter stalls.
        self.stalls = StallWatch(heartbeat_s / 2)
        # How long it holds memory a lost sender may still write into: as long as a rejoin waits.
        self.push_quarantine_s = push_quarantine_s

    async def unmap_gone_receivers(self, period_s: float = UNMAP_GONE_S) -> None:
        """Every ``period_s``, unmap the pools of same-host receivers that exited: a receiver
        scaled away, or dead and not restarted, would otherwise stay resident here until a
        new receiver is mapped. Each writer between its copies: the loop's on the loop, the
        other under the limiter its writes take."""
        if self._writers is None:
            return
        loop_writer, thread_writer = self._writers
        while True:
            await anyio.sleep(period_s)
            loop_writer.forget_gone()
            await anyio.to_thread.run_sync(thread_writer.forget_gone, limiter=self._transfer)

    # ------------------------------------------------------------------ what is held

    def pushing(self, rid: str) -> bool:
        return rid in self._pushing

    @property
    def writing(self) -> bool:
        """Whether any push is under way (its write may be reading or landing)."""
        return bool(self._pushing)

    def holds_output(self, rid: str) -> bool:
        return rid in self._staged or rid in self._pushing

    def holds_input(self, rid: str) -> bool:
        return rid in self._allocs

    def free(self, rid: str) -> None:
        """The request was aborted: free what it holds here, except a block being pushed
        (its push frees it when the write ends)."""
        block = self._allocs.pop(rid, None)
        if block is not None:
            self._pool.free(block)
        if rid not in self._pushing:
            self._refused_after.pop(rid, None)
            block = self._staged.pop(rid, None)
            if block is not None:
                self._pool.free(block)

    def free_everything(self) -> None:
        """The daemon forgot this worker: nothing it ordered is wanted any more. (No push is
        in progress: the runtime waited for every write to end.)"""
        for block in [*self._staged.values(), *self._allocs.values()]:
            self._pool.free(block)
        self._staged.clear()
        self._allocs.clear()
        self._refused_after.clear()

    # ------------------------------------------------------------------ a stage's input and output

    def take_inputs(self, ready: Ready) -> dict[str, torch.Tensor]:
        """Copy the input out of its receive memory (its slot, or the block its Alloc made),
        then give an allocation back at once."""
        block = self._allocs.pop(ready.request_id, None)
        try:
            if block is not None:
                address, size = self._pool.address(block), block.size
            elif ready.slot_id is not None and 0 <= ready.slot_id < len(self._pool.slots):
                slot = self._pool.slots[ready.slot_id]
                address, size = slot.address, slot.size
            else:
                raise ValueError(f"Ready names no memory of this request's (slot {ready.slot_id}, no allocation)")
            if ready.address != address:
                raise ValueError(f"Ready points at {ready.address:#x}, this request's input is at {address:#x}")
            return frames.unpack(self._pool.view_at(address, size), ready.manifest)
        finally:
            if block is not None:
                self._pool.free(block)

    async def stage_output(self, rid: str, outputs: dict[str, torch.Tensor], compute_ms: float) -> None:
        specs, nbytes = frames.layout(outputs)
        block = await self._pool.alloc(nbytes, timeout_s=self._alloc_timeout_s)
        try:
            if nbytes <= INLINE_COPY_BYTES:
                specs = frames.pack(self._pool.view(block), outputs, specs)
            else:
                specs = await anyio.to_thread.run_sync(frames.pack, self._pool.view(block), outputs, specs)
                await anyio.lowlevel.checkpoint_if_cancelled()  # aborted while it copied: nothing staged
        except BaseException:
            self._pool.free(block)
            raise
        # Recorded before Staged leaves, so the Push it leads to always finds the block.
        self._staged[rid] = block
        self._report(Staged(request_id=rid, nbytes=nbytes, manifest=specs, compute_ms=compute_ms))

    # ------------------------------------------------------------------ hand-off orders

    async def alloc(self, order: Alloc) -> None:
        try:
            block = await self._pool.alloc(order.nbytes, timeout_s=self._alloc_timeout_s)
        except PoolError as exc:
            self._report(AllocRejected(request_id=order.request_id, message=brief(str(exc))))
            return
        self._allocs[order.request_id] = block
        self._report(Allocated(request_id=order.request_id, address=self._pool.address(block)))

    async def push(self, order: Push, read_at: float) -> None:
        """Write the staged output ``order`` names where it says; ``read_at``: when the
        runtime read the order (``stalls``' clock)."""
        rid = order.request_id
        if rid in self._pushing:
            # A repeat that came in the same message as the first: the runtime's guard ran
            # before either push had started. Like any repeat, logged and not answered.
            self.log.error("worker.repeated_order", request_id=rid, order="Push")
            return
        block = self._staged.get(rid)
        if block is None:
            self._report(Pushed(request_id=rid, ok=False, transfer_ms=0.0,
                                error=f"nothing staged for {rid!r} of {order.nbytes} bytes"))
            return
        if order.nbytes > block.size:
            # A buggy or forged order: its write would read past the block, into whatever the
            # pool holds next. Nothing is written, and the output is freed as a failed push's is.
            self._unstage(rid, block)
            self._report(Pushed(request_id=rid, ok=False, transfer_ms=0.0,
                                error=f"a push of {order.nbytes} bytes is longer than the output staged for {rid!r} "
                                      f"({block.size} bytes)"))
            return
        self._pushing.add(rid)
        started = time.perf_counter()
        error = ""
        in_doubt = kept = False
        via: Via = "mooncake"
        try:
            via = await self._deliver(order, self._pool.address(block), read_at)
        except StalePush as exc:
            # Its output stays staged: the daemon sends the Push again if that memory is
            # still the request's, or an Abort.
            error, kept = str(exc), True
            self.stalls.look()
            self._refused_after[rid] = self.stalls.count
            self.log.warning("worker.stale_push_refused", request_id=rid, why=error)
        except TransferError as exc:
            error, in_doubt = str(exc), isinstance(exc, TransferInDoubt)
            if in_doubt:
                self.in_doubt_until = time.monotonic() + self.push_quarantine_s
        except Exception as exc:  # the daemon must hear Pushed, whatever happened
            self.log.exception("worker.push_crashed", request_id=rid)
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self._pushing.discard(rid)
            if not kept:
                # Freed even in doubt: a late read of it can only land in receiver memory that
                # the daemon holds back until push_quarantine_s has passed.
                self._unstage(rid, block)
        self._report(Pushed(request_id=rid, ok=not error, transfer_ms=(time.perf_counter() - started) * 1000,
                            error=brief(error), via=via, in_doubt=in_doubt, stood_still=kept))

    def _unstage(self, rid: str, block: Block) -> None:
        """Free ``rid``'s staged output, ``block``, and forget its refused pushes."""
        self._refused_after.pop(rid, None)
        del self._staged[rid]
        self._pool.free(block)

    async def _deliver(self, order: Push, src_addr: int, read_at: float) -> Via:
        """Copy into a same-host receiver's shared pool, else transfer with the engine.

        A small copy runs right here on the loop: it costs less than the hop to a worker
        thread and back (0.4-6 ms on a busy 2-core host). Larger copies and every transfer
        run on worker threads, one at a time (``self._transfer``, a limiter of 1). Each side
        has its own writer, so that neither's mappings change under the other's copy. Whether
        the order is still fresh is asked last, once the limiter is ours: a stall may come
        while it waits for the write before.
        """
        if order.local is not None and self._writers is not None:
            loop_writer, thread_writer = self._writers
            try:
                if order.nbytes <= INLINE_COPY_BYTES:
                    self._check_fresh(order, read_at)
                    loop_writer.write(order.local, src_addr, order.address, order.nbytes)
                else:
                    async with self._transfer:
                        self._check_fresh(order, read_at)
                        await anyio.to_thread.run_sync(thread_writer.write, order.local, src_addr, order.address,
                                                       order.nbytes)
                return "memcpy"
            except LocalCopyError as exc:
                self.log.warning("worker.local_copy_failed", request_id=order.request_id, error=str(exc))
        async with self._transfer:
            self._check_fresh(order, read_at)
            await anyio.to_thread.run_sync(self._engine.write, order.session, src_addr, order.address, order.nbytes)
        return "mooncake"

    def _check_fresh(self, order: Push, read_at: float) -> None:
        refused_after = self._refused_after.get(order.request_id) if order.after_stall else None
        if refused_after is not None:
            # Sent after this worker reported its stall: only a stall since makes it stale.
            stale = self.stalls.stood_still_after(refused_after)
        else:
            stale = self.stalls.stood_still_near(read_at)
        if stale:
            raise StalePush(f"not written: this worker stood still for {self.stalls.stalled_s:.1f}s (stopped, or "
                            "starved) around when it read this push, which may have waited out the stall unread; "
                            "the daemon may have handed the memory it names out again meanwhile")


class StalePush(TransferError):
    """A push the worker read around a stall of its own: it writes nothing."""
