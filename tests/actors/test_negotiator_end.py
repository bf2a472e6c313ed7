"""TransferNegotiator: the one authority over what a placed request holds.

However a flight ends (a Forget, a failure a worker reports, an eviction), the negotiator
frees everything itself: ``Release`` to the current instance's pool, an ``Abort`` to the
current instance, the input slot back to the book, and, with a receiver reserved, ``Release``
to the receiver's pool and the receiver's memory (a preallocated slot, or an ``Abort`` of
an allocation), the memory only once no push can still be writing into it.
"""

from __future__ import annotations

import gc
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio

from actors.flight import Flight
from actors.mail import Enqueue, Failed, Farewell, Forget, HandedOff, Join, Leave, Placed, RunEnded, Send, Tick
from actors.negotiator import PreallocCounts
from tests.actors.negotiator_harness import (
    MANIFEST,
    NBYTES,
    PARAMS,
    POOL_BASE,
    FakeWorker,
    Negotiator,
    aborted,
    allocate_on_slow_path,
    ask_to_allocate,
    encoder_and_denoiser,
    fake_worker,
    job,
    push_on_fast_path,
    register,
    registration,
    released,
    running_negotiator,
    stage_encoder_output,
    stopped_while_running,
    wait_late,
)
from transfer.protocol import (
    DAEMON_TO_WORKER,
    Allocated,
    AllocRejected,
    Done,
    Heartbeat,
    Pushed,
    Ready,
    Reason,
    RegisterRefused,
    Role,
    Staged,
    Stopped,
    TensorSpec,
    Work,
    encode,
)

ALLOCATION = POOL_BASE + 8192


async def forget(n: Negotiator, rid: str, times: int = 1) -> None:
    """``rid``'s Forget, as each pool passes it on (admission tells every pool), all handled."""
    for _ in range(times):
        n.inbox.post(Forget(request_id=rid))
    await n.stats()


async def deliver_to_denoiser(n: Negotiator, encoder: FakeWorker, denoiser: FakeWorker, rid: str) -> None:
    """Fast path through a successful push: the denoiser runs ``rid`` with its input in slot 0."""
    await push_on_fast_path(n, encoder, denoiser, rid)
    await encoder.report(Pushed(request_id=rid, ok=True, transfer_ms=1.0))
    assert await n.pools["denoiser"].receive() == Send(instance=denoiser.instance, order=Ready(
        request_id=rid, params=PARAMS, address=POOL_BASE, manifest=MANIFEST, slot_id=0))
    assert n.take("encoder") == [released(rid, encoder, ok=True)]
    assert isinstance(await n.tracker.receive(), HandedOff)


async def wait_prealloc(n: Negotiator, worker: FakeWorker, free: int) -> None:
    """Wait for a report on the socket to bring ``worker``'s free preallocated slots to ``free``."""
    while (await n.stats()).prealloc[worker.instance].free != free:
        await anyio.sleep(0.005)


# --------------------------------------------------------------------------- Forget, state by state


async def test_forget_while_the_encoder_runs_releases_and_aborts_it(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path) as n, fake_worker(ctx, n, "encoder") as encoder:
            n.inbox.post(Placed(job=job("r1", "encoder"), instance=encoder.instance))
            assert await n.pools["encoder"].receive() == Send(instance=encoder.instance,
                                                              order=Work(request_id="r1", params=PARAMS))
            await forget(n, "r1")
            assert n.take("encoder") == stopped_while_running("r1", encoder, ack=1)
            n.assert_silent()
            await forget(n, "r1", times=2)  # the other pools' copies find nothing
            n.assert_silent()
            # The encoder's report, if it was already on its way, is late: its block is freed.
            await encoder.report(Staged(request_id="r1", nbytes=NBYTES, manifest=MANIFEST, compute_ms=1.0))
            assert (await wait_late(n, 1)).late_reports == 1
            assert n.take("encoder") == [aborted("r1", encoder)]
            n.assert_silent()
            # Its pass over, the encoder answers the ack: the slot the run held is free.
            await encoder.report(Stopped(request_id="r1", ack=1))
            assert await n.pools["encoder"].receive() == RunEnded(instance=encoder.instance)
            n.assert_silent()


async def test_only_the_worker_owing_an_ack_frees_a_slot_with_it_and_only_once(
    ctx: zmq.asyncio.Context, tmp_path: Path, logs: list[dict[str, Any]]
) -> None:
    with anyio.fail_after(5):
        async with (
            running_negotiator(ctx, tmp_path) as n,
            fake_worker(ctx, n, "encoder") as encoder,
            fake_worker(ctx, n, "denoiser", slots=1) as denoiser,
        ):
            n.inbox.post(Placed(job=job("r1", "encoder"), instance=encoder.instance))
            assert isinstance(await n.pools["encoder"].receive(), Send)
            await forget(n, "r1")
            assert n.take("encoder") == stopped_while_running("r1", encoder, ack=1)
            # Another worker, the wrong request, then the right one twice: one slot, once.
            await denoiser.report(Stopped(request_id="r1", ack=1))
            await encoder.report(Stopped(request_id="r2", ack=1))
            await wait_late(n, 2)
            await encoder.report(Stopped(request_id="r1", ack=1))
            assert await n.pools["encoder"].receive() == RunEnded(instance=encoder.instance)
            await encoder.report(Stopped(request_id="r1", ack=1))
            await wait_late(n, 3)
            n.assert_silent()
    # Each late report says, at debug level, what it was and whose.
    late = [(e["report"], e["request_id"], e["instance"]) for e in logs if e["event"] == "worker.late_report"]
    assert late == [("Stopped", "r1", denoiser.instance), ("Stopped", "r2", encoder.instance),
                    ("Stopped", "r1", encoder.instance)]


async def test_forget_while_running_at_a_receiver_recycles_its_input_slot(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """RUNNING at the denoiser, its input in a preallocated slot: slot back, Release to its pool, Abort."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser):
            await deliver_to_denoiser(n, encoder, denoiser, "r1")
            assert (await n.stats()).prealloc[denoiser.instance] == PreallocCounts(1, 2)
            await forget(n, "r1")
            stats = await n.stats()
            assert stats.prealloc[denoiser.instance] == PreallocCounts(2, 2)
            assert stats.handoffs_in_flight == 0
            assert n.take("denoiser") == stopped_while_running("r1", denoiser, ack=1)
            n.assert_silent()  # the encoder's part was over at the hand-off
            await forget(n, "r1", times=2)  # a second recycle of the slot would raise in the actor
            assert (await n.stats()).prealloc[denoiser.instance] == PreallocCounts(2, 2)
            n.assert_silent()


async def test_forget_while_awaiting_a_receiver_releases_and_aborts_the_sender(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser):
            await stage_encoder_output(n, encoder, "r1")
            await forget(n, "r1")
            assert n.take("encoder") == [released("r1", encoder), aborted("r1", encoder)]
            n.assert_silent()  # no receiver yet: nothing for the denoiser pool
            # The denoiser job admission had already dispatched: its slot goes back unused.
            n.inbox.post(Placed(job=job("r1", "denoiser"), instance=denoiser.instance))
            await n.stats()
            assert n.take("denoiser") == [released("r1", denoiser, ok=None)]
            stats = await n.stats()
            assert stats.prealloc[denoiser.instance] == PreallocCounts(2, 2)
            assert (stats.handoffs_in_flight, stats.fast_path, stats.slow_path) == (0, {}, {})
            n.assert_silent()


async def test_forget_while_allocating_releases_both_pools_and_aborts_both(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=0) as (n, encoder, denoiser):
            await ask_to_allocate(n, encoder, denoiser, "r1")
            await forget(n, "r1")
            assert n.take("encoder") == [released("r1", encoder), aborted("r1", encoder)]
            assert n.take("denoiser") == [released("r1", denoiser), aborted("r1", denoiser)]
            assert (await n.stats()).handoffs_in_flight == 0
            n.assert_silent()
            # The allocation was made after all: its late report has it freed, and no push starts.
            await denoiser.report(Allocated(request_id="r1", address=ALLOCATION))
            await wait_late(n, 1)
            assert n.take("denoiser") == [aborted("r1", denoiser)]
            n.assert_silent()


async def test_forget_mid_push_releases_the_pools_now_and_the_slot_when_pushed(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser):
            await push_on_fast_path(n, encoder, denoiser, "r1")
            await forget(n, "r1")
            # Both pool slots free at once (no compute is left to run)...
            assert n.take("encoder") == [released("r1", encoder), aborted("r1", encoder)]
            assert n.take("denoiser") == [released("r1", denoiser)]
            # ...but the encoder may be writing into slot 0 right now: it stays taken.
            stats = await n.stats()
            assert stats.prealloc[denoiser.instance] == PreallocCounts(1, 2)
            assert (stats.handoffs_in_flight, stats.handoffs_held) == (0, 1)
            await forget(n, "r1", times=2)  # the other pools' copies: nothing more is released
            n.assert_silent()

            await encoder.report(Pushed(request_id="r1", ok=True, transfer_ms=1.0))
            await wait_prealloc(n, denoiser, 2)
            stats = await n.stats()
            assert stats.prealloc[denoiser.instance] == PreallocCounts(2, 2)
            assert (stats.handoffs_in_flight, stats.handoffs_held, stats.late_reports) == (0, 0, 0)
            n.assert_silent()  # no Ready, no HandedOff, no second Release

            await encoder.report(Pushed(request_id="r1", ok=True, transfer_ms=1.0))  # a duplicate: late
            assert (await wait_late(n, 1)).prealloc[denoiser.instance] == PreallocCounts(2, 2)
            n.assert_silent()
            # Released, the flight is let go of at once, its prompts with it: not kept until
            # push_quarantine_s has passed (a steady rate of cancels would hold rate x 60 s of them).
            gc.collect()
            assert not [o for o in gc.get_objects() if type(o) is Flight and o.request_id == "r1"]


async def test_forget_mid_push_into_an_allocation_aborts_it_only_when_pushed(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=0) as (n, encoder, denoiser):
            await allocate_on_slow_path(n, encoder, denoiser, "r1", ALLOCATION)
            await forget(n, "r1")
            assert n.take("encoder") == [released("r1", encoder), aborted("r1", encoder)]
            assert n.take("denoiser") == [released("r1", denoiser)]  # no Abort yet: the write may be on
            n.assert_silent()
            await encoder.report(Pushed(request_id="r1", ok=False, transfer_ms=0.0, error="aborted"))
            assert await n.pools["denoiser"].receive() == aborted("r1", denoiser)
            stats = await n.stats()
            assert (stats.handoffs_in_flight, stats.late_reports) == (0, 0)
            n.assert_silent()  # the request already ended: no second Failed


async def test_forget_of_an_unknown_request_changes_nothing(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path) as n, fake_worker(ctx, n, "denoiser", slots=2) as denoiser:
            await forget(n, "nobody", times=3)
            assert (await n.stats()).prealloc[denoiser.instance] == PreallocCounts(2, 2)
            n.assert_silent()


# --------------------------------------------------------------------------- failures reported by workers


async def test_failed_stage_at_a_receiver_counts_as_failed_and_frees_its_input(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser):
            await deliver_to_denoiser(n, encoder, denoiser, "r1")
            await denoiser.report(Done(request_id="r1", ok=False, compute_ms=2.0, reason=Reason.STAGE_FAILED,
                                       error="nan"))
            assert await n.tracker.receive() == Failed(request_id="r1", reason=Reason.STAGE_FAILED,
                                                       message=f"{denoiser.instance}: nan",
                                                       avoid=frozenset({denoiser.instance}))
            assert n.take("denoiser") == [released("r1", denoiser, ok=False), aborted("r1", denoiser)]
            assert (await n.stats()).prealloc[denoiser.instance] == PreallocCounts(2, 2)
            await forget(n, "r1", times=3)
            n.assert_silent()


@pytest.mark.parametrize("bad", [
    TensorSpec(name="embeds", dtype="float32", shape=(128,), offset=NBYTES, nbytes=NBYTES, xxh3=1),
    # Its copy would go unchecked at the receiver (an audit's fake sender, whose Push wrote
    # nothing, had the receiver compute on what an earlier request left in the slot).
    msgspec.structs.replace(MANIFEST[0], xxh3=None),
], ids=["past its block", "without its digest"])
async def test_invalid_staged_output_fails_the_stage(ctx: zmq.asyncio.Context, tmp_path: Path,
                                                     bad: TensorSpec) -> None:
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path) as n, fake_worker(ctx, n, "encoder") as encoder:
            n.inbox.post(Placed(job=job("r1", "encoder"), instance=encoder.instance))
            await n.pools["encoder"].receive()  # Work
            await encoder.report(Staged(request_id="r1", nbytes=NBYTES, manifest=[bad], compute_ms=1.0))
            failed = await n.tracker.receive()
            assert (failed.request_id, failed.reason) == ("r1", Reason.STAGE_FAILED)
            assert failed.message.startswith(f"{encoder.instance} staged an invalid output ['embeds']")
            assert n.take("encoder") == [released("r1", encoder, ok=False), aborted("r1", encoder)]
            n.assert_silent()  # nothing enqueued for a denoiser


@pytest.mark.parametrize("report", [
    AllocRejected(request_id="r1", message="pool full"),
    Allocated(request_id="r1", address=0),  # below pool_base
], ids=["alloc rejected", "allocation outside the pool"])
async def test_a_failed_allocation_releases_both_pools_and_fails(ctx: zmq.asyncio.Context, tmp_path: Path,
                                                                  report: AllocRejected | Allocated) -> None:
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=0) as (n, encoder, denoiser):
            await ask_to_allocate(n, encoder, denoiser, "r1")
            await denoiser.report(report)
            failed = await n.tracker.receive()
            assert (failed.request_id, failed.reason) == ("r1", Reason.TRANSFER_FAILED)
            assert n.take("encoder") == [released("r1", encoder), aborted("r1", encoder)]
            assert n.take("denoiser") == [released("r1", denoiser), aborted("r1", denoiser)]
            assert (await n.stats()).handoffs_in_flight == 0
            n.assert_silent()  # no Push


# --------------------------------------------------------------------------- eviction


async def reregister(ctx: zmq.asyncio.Context, n: Negotiator, role: Role, *, slots: int,
                     stack: ExitStack) -> tuple[FakeWorker, list[Any]]:
    """The ``role`` worker restarts on the same endpoint (its Mooncake session: the old process
    is dead, or this is it) under its name, on a new connection: the old instance is evicted.

    Returns the new worker and what the negotiator posted to ``role``'s pool meanwhile, up to
    (not including) the new instance's Join.
    """
    sock = stack.enter_context(ctx.socket(zmq.DEALER))
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(n.endpoint)
    registered = await register(sock, role, f"{role}-session", slots)
    posted = n.take(role)
    assert isinstance(posted[-1], Join) and posted[-1].instance == registered.instance
    # The door forgets the old instance's limits and binds the new one's.
    assert [(m.instance, m.limits is None) for m in n.take("frontend")] == [
        (posted[0].instance, True), (registered.instance, False)]
    return FakeWorker(sock, registered.instance, f"{role}-session", registered.key), posted[:-1]


async def test_a_silent_sender_whose_name_registers_anew_mid_push_frees_the_receivers_slot_at_once(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """A restart: the old process went silent (killed) before the new one registered."""
    with anyio.fail_after(5), ExitStack() as stack:
        async with encoder_and_denoiser(ctx, tmp_path, slots=2, heartbeat_s=0.05) as (n, encoder, denoiser):
            await push_on_fast_path(n, encoder, denoiser, "r1")
            await anyio.sleep(0.15)  # three beats of silence
            _, posted = await reregister(ctx, n, "encoder", slots=0, stack=stack)
            assert isinstance(posted[0], Leave) and posted[0].instance == encoder.instance
            assert n.take("denoiser") == [released("r1", denoiser)]
            failed = await n.tracker.receive()
            assert (failed.request_id, failed.reason) == ("r1", Reason.WORKER_LOST)
            stats = await n.stats()
            assert stats.prealloc[denoiser.instance] == PreallocCounts(2, 2)  # nobody writes any more
            assert stats.handoffs_in_flight == 0


async def test_a_live_sender_whose_name_registers_anew_mid_push_keeps_the_receivers_slot_until_the_quarantine(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Heard from just now: its writes may not all have ended yet (a write the old process
    started, the daemon cannot tell), so the slot waits out the quarantine."""
    with anyio.fail_after(5), ExitStack() as stack:
        async with encoder_and_denoiser(ctx, tmp_path, slots=2, push_quarantine_s=0.3) as (n, encoder, denoiser):
            await push_on_fast_path(n, encoder, denoiser, "r1")
            _, posted = await reregister(ctx, n, "encoder", slots=0, stack=stack)
            assert isinstance(posted[0], Leave) and posted[0].instance == encoder.instance
            assert posted[1:] == [released("r1", encoder), aborted("r1", encoder)]  # dropped by the pool
            assert n.take("denoiser") == [released("r1", denoiser)]
            failed = await n.tracker.receive()
            assert (failed.request_id, failed.reason) == ("r1", Reason.WORKER_LOST)
            stats = await n.stats()
            assert stats.prealloc[denoiser.instance] == PreallocCounts(1, 2)  # the old sender may be writing
            assert (stats.handoffs_in_flight, stats.handoffs_held) == (0, 1)
            await anyio.sleep(0.35)
            n.inbox.post(Tick())
            stats = await n.stats()
            assert stats.prealloc[denoiser.instance] == PreallocCounts(2, 2)
            assert (stats.handoffs_in_flight, stats.handoffs_held) == (0, 0)
            await forget(n, "r1", times=3)
            n.assert_silent()


async def test_a_dead_receiver_mid_push_keeps_its_allocation_until_pushed(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5), ExitStack() as stack:
        async with encoder_and_denoiser(ctx, tmp_path, slots=0) as (n, encoder, denoiser):
            await allocate_on_slow_path(n, encoder, denoiser, "r1", ALLOCATION)
            _, posted = await reregister(ctx, n, "denoiser", slots=0, stack=stack)
            assert isinstance(posted[0], Leave) and posted[0].instance == denoiser.instance
            assert posted[1:] == [released("r1", denoiser)]  # no Abort while the encoder may write
            assert n.take("encoder") == [released("r1", encoder), aborted("r1", encoder)]
            failed = await n.tracker.receive()
            assert (failed.request_id, failed.reason) == ("r1", Reason.WORKER_LOST)
            stats = await n.stats()
            assert (stats.handoffs_in_flight, stats.handoffs_held) == (0, 1)
            await forget(n, "r1", times=3)
            n.assert_silent()
            await encoder.report(Pushed(request_id="r1", ok=False, transfer_ms=0.0, error="peer gone"))
            # The abort goes to the pool, which drops it (the instance left with its memory).
            assert await n.pools["denoiser"].receive() == aborted("r1", denoiser)
            stats = await n.stats()
            assert (stats.handoffs_in_flight, stats.handoffs_held) == (0, 0)
            n.assert_silent()


async def test_a_silent_sender_mid_push_keeps_the_receivers_slot_until_its_quarantine_ends(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Evicted for silence, a sender may still be alive and writing: the slot waits it out."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2, heartbeat_s=0.05, heartbeat_misses=2,
                                        push_quarantine_s=0.4) as (n, encoder, denoiser):
            await push_on_fast_path(n, encoder, denoiser, "r1")

            async def beat_until(check) -> float:  # only the denoiser keeps beating
                started = time.monotonic()
                while not check(await n.stats()):
                    await denoiser.report(Heartbeat())
                    n.inbox.post(Tick())
                    await anyio.sleep(0.02)
                return time.monotonic() - started

            await beat_until(lambda s: encoder.instance not in s.prealloc)
            failed = await n.tracker.receive()
            assert (failed.request_id, failed.reason) == ("r1", Reason.WORKER_LOST)
            assert (await n.stats()).prealloc[denoiser.instance] == PreallocCounts(1, 2)
            waited = await beat_until(lambda s: s.prealloc[denoiser.instance] == PreallocCounts(2, 2))
            assert waited >= 0.25, "released before the quarantine ended"


@pytest.mark.parametrize("pushing", [False, True], ids=["idle", "a-push-into-it-in-flight"])
async def test_a_receiver_evicted_while_nothing_was_written_into_it_may_rejoin_without_the_quarantine(
    ctx: zmq.asyncio.Context, tmp_path: Path, pushing: bool
) -> None:
    """Frozen past heartbeat_misses (a long pause, a stopped VM), it is evicted; what it says
    on waking is answered rejoin, and settled if no write was ordered into its memory: before,
    an idle denoiser sat out push_quarantine_s (60 s by default) with nothing to wait for."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2, heartbeat_s=0.05,
                                        heartbeat_misses=3) as (n, encoder, denoiser):
            if pushing:
                await push_on_fast_path(n, encoder, denoiser, "r1")
            while denoiser.instance in (await n.stats()).prealloc:  # only the encoder speaks
                await encoder.report(Heartbeat())
                n.inbox.post(Tick())
                await anyio.sleep(0.02)
            await denoiser.report(Heartbeat())
            refused = DAEMON_TO_WORKER.decode(await denoiser.sock.recv())
            assert isinstance(refused, RegisterRefused) and refused.message.startswith("not registered")
            assert refused.rejoin and refused.settled is not pushing


async def test_the_old_connection_of_a_name_taken_over_is_told_to_stop(ctx: zmq.asyncio.Context,
                                                                       tmp_path: Path) -> None:
    """Were it alive after all (frozen, then woken), it would otherwise rejoin and evict its
    successor."""
    with anyio.fail_after(5), ExitStack() as stack:
        async with encoder_and_denoiser(ctx, tmp_path, slots=1) as (n, _, denoiser):
            await reregister(ctx, n, "denoiser", slots=1, stack=stack)
            refused = DAEMON_TO_WORKER.decode(await denoiser.sock.recv())
            assert isinstance(refused, RegisterRefused) and not refused.rejoin
            assert refused.message == ("another worker registered under the name 'denoiser-worker': "
                                       "worker names must be unique")


async def test_a_farewell_tells_each_worker_to_rejoin_and_which_may_skip_the_quarantine(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """The daemon stops: each worker rejoins its successor at once; the denoiser, which a
    push may still be writing into, waits out push_quarantine_s first, the encoder need not."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser):
            await push_on_fast_path(n, encoder, denoiser, "r1")
            n.inbox.post(Farewell())
            await n.stats()
            for worker, settled in ((encoder, True), (denoiser, False)):
                farewell = DAEMON_TO_WORKER.decode(await worker.sock.recv())
                assert farewell == RegisterRefused(message="the daemon is stopping", rejoin=True, settled=settled)
            with ctx.socket(zmq.DEALER) as late:  # a worker rejoining too soon: it meets the next daemon
                late.connect(n.endpoint)
                await late.send(encode(registration("decoder", "s", 1)))
                assert not await late.poll(200)


@pytest.mark.parametrize("claimed", [Reason.DUPLICATE, Reason.WORKER_LOST, Reason.CANCELLED])
async def test_a_failure_reason_no_stage_gives_reads_as_stage_failed(
    ctx: zmq.asyncio.Context, tmp_path: Path, claimed: Reason
) -> None:
    """A worker's word does not tell the client its request was a duplicate, nor start a retry."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser):
            await deliver_to_denoiser(n, encoder, denoiser, "r1")
            await denoiser.report(Done(request_id="r1", ok=False, compute_ms=2.0, reason=claimed, error="odd"))
            assert await n.tracker.receive() == Failed(request_id="r1", reason=Reason.STAGE_FAILED,
                                                       message=f"{denoiser.instance}: odd",
                                                       avoid=frozenset({denoiser.instance}))


async def test_what_a_retry_avoids_and_its_turn_follow_it_to_the_next_stage(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, _):
            avoid = frozenset({"denoiser-7"})
            n.inbox.post(Placed(job=msgspec.structs.replace(job("r1", "encoder"), avoid=avoid, again=True),
                                instance=encoder.instance))
            await n.pools["encoder"].receive()  # Work
            await encoder.report(Staged(request_id="r1", nbytes=NBYTES, manifest=MANIFEST, compute_ms=1.0))
            assert await n.admission.receive() == Enqueue(job=msgspec.structs.replace(job("r1", "denoiser"),
                                                                                      avoid=avoid, again=True))
