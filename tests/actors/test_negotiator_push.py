"""TransferNegotiator: hand-offs, including failed and forgotten pushes (harness in negotiator_harness.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio

import actors.handoffs
import transfer.engine
from actors.mail import Failed, Forget, HandedOff, Leave, Placed, Release, Send, Suspect, Tick
from actors.negotiator import PreallocCounts
from tests.actors.negotiator_harness import (
    HOP,
    MANIFEST,
    NBYTES,
    PARAMS,
    POOL_BASE,
    SLOT_SIZE,
    TOKEN,
    FakeWorker,
    Negotiator,
    aborted,
    allocate_on_slow_path,
    encoder_and_denoiser,
    fake_worker,
    job,
    next_order,
    push_on_fast_path,
    registration,
    released,
    running_negotiator,
    speak,
    stage_encoder_output,
    stopped_while_running,
    wait_late,
)
from transfer.protocol import (
    DAEMON_TO_WORKER,
    PROTOCOL_VERSION,
    Alloc,
    Heartbeat,
    Leaving,
    Push,
    Pushed,
    Ready,
    Reason,
    Register,
    Registered,
    RegisterRefused,
    SlotInfo,
    Staged,
    Stopping,
    TensorSpec,
    encode,
)


def suspected(worker: FakeWorker, suspect: bool = True) -> Suspect:
    return Suspect(instance=worker.instance, suspect=suspect)


# --------------------------------------------------------------------------- the next stage's job


async def test_the_next_stages_job_and_order_keep_the_requests_priority(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=1) as (n, encoder, denoiser):
            await stage_encoder_output(n, encoder, "r1", priority=9)
            n.inbox.post(Placed(job=job("r1", "denoiser", 9), instance=denoiser.instance))
            assert isinstance((await n.pools["encoder"].receive()).order, Push)
            await encoder.report(Pushed(request_id="r1", ok=True, transfer_ms=1.0))
            sent = await n.pools["denoiser"].receive()
            assert isinstance(sent, Send) and isinstance(sent.order, Ready) and sent.order.priority == 9


# --------------------------------------------------------------------------- failed push


async def test_failed_push_frees_the_receivers_slot_and_fails_the_request(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser):
            assert (await n.stats()).prealloc[denoiser.instance] == PreallocCounts(2, 2)
            await push_on_fast_path(n, encoder, denoiser, "r1")

            await encoder.report(Pushed(request_id="r1", ok=False, transfer_ms=0.0, error="link down"))
            assert await n.tracker.receive() == Failed(
                request_id="r1", reason=Reason.TRANSFER_FAILED,
                message=f"{encoder.instance} -> {denoiser.instance}: link down",
                avoid=frozenset({encoder.instance, denoiser.instance}))  # a retry goes elsewhere if it can
            # The negotiator frees everything itself: the sender's slot (its stage failed) and
            # staged block, and the receiver's reservation (unused).
            assert n.take("encoder") == [
                released("r1", encoder, ok=False),
                aborted("r1", encoder),
            ]
            # The receiver may be dead: it gets no new work until it is heard from.
            assert n.take("denoiser") == [suspected(denoiser), released("r1", denoiser)]
            stats = await n.stats()
            assert stats.prealloc[denoiser.instance] == PreallocCounts(2, 2)  # back at once
            assert stats.handoffs_in_flight == 0
            n.assert_silent()  # a preallocated slot needs no abort; no Ready goes out

            # The tracker's Forget comes back through admission and every pool: nothing left to
            # free (recycling the slot twice would raise inside the actor).
            for _ in range(3):
                n.inbox.post(Forget(request_id="r1"))
            stats = await n.stats()
            assert stats.prealloc[denoiser.instance] == PreallocCounts(2, 2)
            n.assert_silent()


# The sender stood still around when it read r1's Push: it wrote nothing and kept its output.
STOOD_STILL = Pushed(request_id="r1", ok=False, transfer_ms=0.0, error="not written: stood still", stood_still=True)


async def test_a_push_its_sender_refused_for_a_stall_goes_again_while_the_request_lives(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Nothing was written and the receiver's slot is still the request's: the same Push goes
    again, marked as sent after the stall; nothing fails, nothing is retried."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser):
            await push_on_fast_path(n, encoder, denoiser, "r1")
            await encoder.report(STOOD_STILL)
            again = await n.pools["encoder"].receive()
            assert isinstance(again, Send) and isinstance(again.order, Push) and again.order.after_stall
            assert again.order.address == POOL_BASE and again.order.session == denoiser.session
            await encoder.report(Pushed(request_id="r1", ok=True, transfer_ms=1.0))
            sent = await n.pools["denoiser"].receive()
            assert isinstance(sent, Send) and isinstance(sent.order, Ready) and sent.order.address == POOL_BASE
            assert isinstance(await n.tracker.receive(), HandedOff)
            assert (await n.stats()).late_reports == 0


async def test_a_sender_that_stands_still_at_every_push_fails_the_hand_off_instead_of_a_push_loop(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """A sender refusing each Push for a stall (a broken one, or one frozen over and over)
    was sent the Push again in a loop, thousands a second, until the request's deadline (an
    audit): past STALLED_PUSHES_MAX the hand-off fails transfer_failed, retried avoiding
    both ends, and both ends are freed (nothing was written)."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser):
            await push_on_fast_path(n, encoder, denoiser, "r1")
            for _ in range(actors.handoffs.STALLED_PUSHES_MAX):
                await encoder.report(STOOD_STILL)
                again = await n.pools["encoder"].receive()
                assert isinstance(again, Send) and isinstance(again.order, Push) and again.order.after_stall
            await encoder.report(STOOD_STILL)
            failed = await n.tracker.receive()
            assert isinstance(failed, Failed) and failed.reason == Reason.TRANSFER_FAILED
            assert failed.message == f"{encoder.instance} stood still at each of 4 pushes of its output and wrote none"
            assert failed.avoid == {encoder.instance, denoiser.instance}
            assert n.take("encoder") == [released("r1", encoder), aborted("r1", encoder)]
            assert n.take("denoiser") == [released("r1", denoiser)]
            stats = await n.stats()
            assert stats.prealloc[denoiser.instance] == PreallocCounts(2, 2) and stats.handoffs_held == 0


async def test_a_push_refused_for_a_stall_after_its_request_ended_frees_both_ends(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """The request ended mid-push: nothing was written, so the receiver's slot is free at
    once, and the sender is told to drop the output it kept."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser):
            await push_on_fast_path(n, encoder, denoiser, "r1")
            n.inbox.post(Forget(request_id="r1"))
            assert (await n.stats()).handoffs_held == 1
            assert n.take("encoder") == [released("r1", encoder), aborted("r1", encoder)]
            n.take("denoiser")
            await encoder.report(STOOD_STILL)
            assert await n.pools["encoder"].receive() == aborted("r1", encoder)
            stats = await n.stats()
            assert stats.prealloc[denoiser.instance] == PreallocCounts(2, 2) and stats.handoffs_held == 0
            n.assert_silent()
            # Its push long gone (the quarantine ended, say): the output it kept is freed too.
            await encoder.report(STOOD_STILL)
            assert await n.pools["encoder"].receive() == aborted("r1", encoder)
            assert (await wait_late(n, 1)).late_reports == 1


async def fail_a_push_into(n: Negotiator, encoder: FakeWorker, denoiser: FakeWorker, rid: str) -> None:
    await push_on_fast_path(n, encoder, denoiser, rid)
    await encoder.report(Pushed(request_id=rid, ok=False, transfer_ms=0.0, error="peer unreachable"))
    assert isinstance(await n.tracker.receive(), Failed)
    n.take("encoder")
    assert n.take("denoiser") == [suspected(denoiser), released(rid, denoiser)]


# r1's push timed out: the write may still land.
IN_DOUBT = Pushed(request_id="r1", ok=False, transfer_ms=6000.0, error="timed out", in_doubt=True)


async def push_r1(n: Negotiator, encoder: FakeWorker, denoiser: FakeWorker, *, into_slot: bool) -> None:
    """The encoder is told to push r1 into a preallocated slot of the denoiser, or into an
    allocation it made."""
    if into_slot:
        await push_on_fast_path(n, encoder, denoiser, "r1")
    else:
        await allocate_on_slow_path(n, encoder, denoiser, "r1", POOL_BASE + 8192)


@pytest.mark.parametrize("slots", [2, 0], ids=["preallocated slot", "allocation"])
async def test_a_push_in_doubt_keeps_the_receivers_memory_until_the_quarantine_ends(
    ctx: zmq.asyncio.Context, tmp_path: Path, slots: int
) -> None:
    """A write the sender stopped waiting for may still land: what it was writing into is
    not handed out again (slot recycled, allocation aborted) before push_quarantine_s, even
    when the report comes twice."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=slots, push_quarantine_s=0.3) as (n, encoder, denoiser):
            await push_r1(n, encoder, denoiser, into_slot=bool(slots))
            started = time.monotonic()
            await encoder.report(IN_DOUBT)
            failed = await n.tracker.receive()
            assert (failed.request_id, failed.reason) == ("r1", Reason.TRANSFER_FAILED)
            await encoder.report(IN_DOUBT)  # a repeat: late, it frees nothing
            await wait_late(n, 1)
            assert n.take("encoder") == [released("r1", encoder, ok=False), aborted("r1", encoder)]
            assert n.take("denoiser") == [suspected(denoiser), released("r1", denoiser)]  # its capacity, at once
            held = PreallocCounts(1, 2) if slots else None
            while time.monotonic() - started < 0.25:
                n.inbox.post(Tick())
                stats = await n.stats()
                assert stats.prealloc[denoiser.instance] == (held or stats.prealloc[denoiser.instance])
                assert (stats.handoffs_in_flight, stats.handoffs_held) == (0, 1)
                n.assert_silent()  # no Abort of the allocation yet
                await anyio.sleep(0.05)
            await anyio.sleep(0.1)
            n.inbox.post(Tick())
            stats = await n.stats()
            assert (stats.handoffs_in_flight, stats.handoffs_held) == (0, 0)
            if slots:
                assert stats.prealloc[denoiser.instance] == PreallocCounts(2, 2)
            else:
                assert n.take("denoiser") == [aborted("r1", denoiser)]


@pytest.mark.parametrize("slots", [2, 0], ids=["preallocated slot", "allocation"])
async def test_a_push_in_doubt_after_its_request_ended_keeps_the_memory_a_quarantine_from_its_report(
    ctx: zmq.asyncio.Context, tmp_path: Path, slots: int
) -> None:
    """The request ends mid-push, and its receiver's memory waits for the push's report. The
    push then reports a timeout: the write may still land, so the memory waits out
    push_quarantine_s from that report, not from the request's end; a repeat of the report
    is late and changes nothing."""
    with anyio.fail_after(10):
        async with encoder_and_denoiser(ctx, tmp_path, slots=slots, push_quarantine_s=1.0) as (n, encoder, denoiser):
            await push_r1(n, encoder, denoiser, into_slot=bool(slots))
            n.inbox.post(Forget(request_id="r1"))
            await anyio.sleep(0.5)  # half the quarantine the request's end started
            await n.stats()
            n.take("encoder")
            n.take("denoiser")
            reported = time.monotonic()
            await encoder.report(IN_DOUBT)
            await encoder.report(IN_DOUBT)
            await wait_late(n, 1)
            while time.monotonic() - reported < 0.8:
                n.inbox.post(Tick())
                stats = await n.stats()
                assert (stats.handoffs_in_flight, stats.handoffs_held) == (0, 1)
                if slots:
                    assert stats.prealloc[denoiser.instance] == PreallocCounts(1, 2)
                n.assert_silent()  # no Abort of the allocation yet
                await anyio.sleep(0.05)
            await anyio.sleep(0.3)
            n.inbox.post(Tick())
            stats = await n.stats()
            assert (stats.handoffs_in_flight, stats.handoffs_held, stats.late_reports) == (0, 0, 1)
            if slots:
                assert stats.prealloc[denoiser.instance] == PreallocCounts(2, 2)
            else:
                assert n.take("denoiser") == [aborted("r1", denoiser)]


async def test_a_suspect_receiver_heard_from_again_is_trusted(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """The push failed for another reason (a link, the sender): one heartbeat clears it."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser):
            await fail_a_push_into(n, encoder, denoiser, "r1")
            await denoiser.report(Heartbeat())
            assert await n.pools["denoiser"].receive() == suspected(denoiser, False)
            await denoiser.report(Heartbeat())
            await n.stats()
            n.assert_silent()  # trusted once, not on every message


async def test_a_register_repeated_on_a_live_connection_is_a_sign_of_life_and_nothing_else(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """A worker whose Register was retried before the answer reached it: the first answer
    stands, whatever the repeat says, and no answer comes back."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser):
            await fail_a_push_into(n, encoder, denoiser, "r1")
            await denoiser.report(registration("denoiser", "another-session", 0, token="a wrong token"))
            assert await n.pools["denoiser"].receive() == suspected(denoiser, False)
            assert (await n.stats()).prealloc[denoiser.instance] == PreallocCounts(2, 2)
            n.assert_silent()
            assert await denoiser.sock.poll(100) == 0


async def test_a_suspect_receiver_that_stays_silent_is_evicted_in_two_heartbeats(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Not after heartbeat_misses (5 here): a dead receiver would take every hand-off sent its way."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2, heartbeat_s=0.2) as (n, encoder, denoiser):
            await fail_a_push_into(n, encoder, denoiser, "r1")
            await anyio.sleep(0.3)
            n.inbox.post(Tick())  # 1.5 heartbeats: not yet
            await n.stats()
            n.assert_silent()
            await anyio.sleep(0.15)
            await speak(n, encoder)
            n.inbox.post(Tick())  # 2.25 heartbeats of silence since the failure
            leave = await n.pools["denoiser"].receive()
            assert isinstance(leave, Leave) and leave.instance == denoiser.instance
            assert "went silent after a push into it failed" in leave.message
            n.assert_withdrawn("denoiser", denoiser.instance)
            assert denoiser.instance not in (await n.stats()).prealloc
            n.assert_silent()  # the encoder, which spoke, stays


async def test_a_worker_silent_for_two_heartbeats_gets_no_new_work_until_heard_from(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Dead, frozen or cut off: work sent to it now would wait for its eviction
    (heartbeat_misses, 5 here) to start again elsewhere."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2, heartbeat_s=0.2) as (n, encoder, denoiser):
            await anyio.sleep(0.3)
            await speak(n, encoder)
            n.inbox.post(Tick())  # the denoiser: 1.5 heartbeats of silence
            await n.stats()
            n.assert_silent()
            await anyio.sleep(0.15)
            await speak(n, encoder)
            n.inbox.post(Tick())  # 2.25
            assert await n.pools["denoiser"].receive() == suspected(denoiser)
            n.inbox.post(Tick())  # still quiet: said once
            await n.stats()
            n.assert_silent()
            await speak(n, denoiser)
            assert n.take("denoiser") == [suspected(denoiser, False)]
            assert denoiser.instance in (await n.stats()).prealloc  # never evicted
            n.assert_silent()


async def test_slot_freed_by_a_failed_push_serves_the_next_hand_off(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=1) as (n, encoder, denoiser):
            await stage_encoder_output(n, encoder, "r1")
            n.inbox.post(Placed(job=job("r1", "denoiser"), instance=denoiser.instance))
            assert isinstance((await n.pools["encoder"].receive()).order, Push)
            await encoder.report(Pushed(request_id="r1", ok=False, transfer_ms=0.0, error="link down"))
            await n.tracker.receive()  # Failed
            n.take("encoder")  # Release, Abort
            n.take("denoiser")  # Suspect, Release
            await stage_encoder_output(n, encoder, "r2")
            n.inbox.post(Placed(job=job("r2", "denoiser"), instance=denoiser.instance))
            send = await n.pools["encoder"].receive()
            assert send.order == Push(request_id="r2", session=denoiser.session, address=POOL_BASE, nbytes=NBYTES)
            assert (await n.stats()).fast_path == {}  # reserved, not made
            await encoder.report(Pushed(request_id="r2", ok=True, transfer_ms=1.0))
            await n.tracker.receive()  # HandedOff
            # Counted once made: r1's failed push was no hand-off (its latency and bytes count
            # nowhere either), and the two counts must agree for whoever divides one by the other.
            assert (await n.stats()).fast_path == {HOP: 1}


async def test_failed_push_into_an_allocation_aborts_it_at_the_receiver(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Slow path: the receiver allocated for the push; once the push fails it is told to free it."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=0) as (n, encoder, denoiser):
            await allocate_on_slow_path(n, encoder, denoiser, "r1", POOL_BASE + 8192)

            await encoder.report(Pushed(request_id="r1", ok=False, transfer_ms=0.0, error="link down"))
            failed = await n.tracker.receive()
            assert (failed.request_id, failed.reason) == ("r1", Reason.TRANSFER_FAILED)
            assert n.take("encoder") == [
                released("r1", encoder, ok=False),
                aborted("r1", encoder),
            ]
            assert n.take("denoiser") == [
                suspected(denoiser),
                released("r1", denoiser),
                aborted("r1", denoiser),
            ]
            stats = await n.stats()
            assert (stats.handoffs_in_flight, stats.slow_path) == (0, {})  # a failed push is no hand-off
            n.assert_silent()
            n.inbox.post(Forget(request_id="r1"))  # no second Abort: the flight is gone
            await n.stats()
            n.assert_silent()


async def test_report_after_a_failed_push_is_late(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser):
            await push_on_fast_path(n, encoder, denoiser, "r1")
            await encoder.report(Pushed(request_id="r1", ok=False, transfer_ms=0.0, error="link down"))
            await n.tracker.receive()
            await encoder.report(Pushed(request_id="r1", ok=True, transfer_ms=1.0))
            stats = await wait_late(n, 1)
            assert stats.late_reports == 1
            assert stats.prealloc[denoiser.instance] == PreallocCounts(2, 2)
            assert [type(m) for m in n.take("encoder")] == [Release, Send]  # the first report's
            assert n.take("denoiser") == [suspected(denoiser), released("r1", denoiser)]
            n.assert_silent()


# --------------------------------------------------------------------------- inputs only a slot holds


async def test_an_input_only_a_slot_can_hold_waits_for_one_instead_of_failing(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """A denoiser of capacity 2 with one slot and a 256-byte region: a 512-byte input fits
    only the slot. Before, with the slot taken, it was asked to allocate in its region,
    refused ("can never fit"), and the request failed with transfer_failed."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=1, pool_size=SLOT_SIZE + 256) as (n, encoder, denoiser):
            pushed_into_the_slot = {rid: Send(instance=encoder.instance, order=Push(
                request_id=rid, session=denoiser.session, address=POOL_BASE, nbytes=NBYTES)) for rid in ("r1", "r2")}
            await stage_encoder_output(n, encoder, "r1")
            n.inbox.post(Placed(job=job("r1", "denoiser"), instance=denoiser.instance))
            assert await n.pools["encoder"].receive() == pushed_into_the_slot["r1"]
            await encoder.report(Pushed(request_id="r1", ok=True, transfer_ms=1.0))
            assert await n.pools["encoder"].receive() == released("r1", encoder, ok=True)
            assert isinstance(await n.tracker.receive(), HandedOff)
            assert isinstance((await n.pools["denoiser"].receive()).order, Ready)  # r1 runs, its input in the slot

            await stage_encoder_output(n, encoder, "r2")
            n.inbox.post(Placed(job=job("r2", "denoiser"), instance=denoiser.instance))
            await stage_encoder_output(n, encoder, "r3")
            n.inbox.post(Placed(job=job("r3", "denoiser"), instance=denoiser.instance))
            stats = await n.stats()
            assert (stats.handoffs_in_flight, stats.fast_path, stats.slow_path) == (2, {HOP: 1}, {})
            n.assert_silent()  # no Alloc: both wait for the slot, r2 first
            # r3 ends while it waits: it holds nothing at the denoiser, so nothing is aborted there.
            n.inbox.post(Forget(request_id="r3"))
            await n.stats()
            assert n.take("encoder") == [released("r3", encoder), aborted("r3", encoder)]
            assert n.take("denoiser") == [released("r3", denoiser)]

            await denoiser.report(Staged(request_id="r1", nbytes=NBYTES, manifest=MANIFEST, compute_ms=1.0))
            assert (await n.admission.receive()).job.request_id == "r1"  # on to the decoders
            assert await n.pools["encoder"].receive() == pushed_into_the_slot["r2"]
            stats = await n.stats()
            assert (stats.handoffs_in_flight, stats.fast_path, stats.slow_path) == (2, {HOP: 1}, {})  # r2's unmade
            assert stats.prealloc[denoiser.instance] == PreallocCounts(0, 1)
            n.assert_silent()


async def stage_and_place(n: Negotiator, encoder: FakeWorker, denoiser: FakeWorker, rid: str, nbytes: int) -> None:
    """``rid``'s encoder staged ``nbytes``, and the denoiser pool placed it at ``denoiser``."""
    n.inbox.post(Placed(job=job(rid, "encoder"), instance=encoder.instance))  # its Work stays in the encoder's mail
    manifest = [TensorSpec(name="embeds", dtype="uint8", shape=(nbytes,), offset=0, nbytes=nbytes, xxh3=1)]
    await encoder.report(Staged(request_id=rid, nbytes=nbytes, manifest=manifest, compute_ms=1.0))
    assert (await n.admission.receive()).job.request_id == rid
    n.inbox.post(Placed(job=msgspec.structs.replace(job(rid, "denoiser"), nbytes=nbytes), instance=denoiser.instance))


def pushes(n: Negotiator) -> list[tuple[str, int]]:
    """(request, address) of every Push ordered since last asked."""
    return [(mail.order.request_id, mail.order.address) for mail in n.take("encoder")
            if isinstance(mail, Send) and isinstance(mail.order, Push)]


async def test_the_line_for_slots_moves_on_when_its_first_ends_and_newcomers_join_its_end(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Slots of 2,048 (A) and 1,024 bytes (B), a 256-byte region. r1 (1,500 bytes) holds A,
    r2 (600) B; r3 (1,500) and r4 (600) wait. B frees, which r3, first, cannot use. An audit
    found that when r3 then ended, r4 went on waiting beside the free B, and a later r5 took
    B ahead of it."""
    a, b = POOL_BASE, POOL_BASE + 2048
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=[2048, 1024], pool_size=3072 + 256) as (n, encoder,
                                                                                                     denoiser):
            for rid, nbytes in [("r1", 1500), ("r2", 600)]:
                await stage_and_place(n, encoder, denoiser, rid, nbytes)
                await encoder.report(Pushed(request_id=rid, ok=True, transfer_ms=1.0))
                assert isinstance((await n.pools["denoiser"].receive()).order, Ready)
            assert pushes(n) == [("r1", a), ("r2", b)]
            for rid, nbytes in [("r3", 1500), ("r4", 600)]:
                await stage_and_place(n, encoder, denoiser, rid, nbytes)
            await denoiser.report(Staged(request_id="r2", nbytes=NBYTES, manifest=MANIFEST, compute_ms=1.0))
            await n.admission.receive()
            assert pushes(n) == []  # r3 waits for A, and r4 behind it
            await stage_and_place(n, encoder, denoiser, "r5", 600)
            n.inbox.post(Forget(request_id="r3"))
            await n.stats()
            assert pushes(n) == [("r4", b)]  # r5 joined the line behind r4, not ahead of it
            assert n.take("denoiser") == [released("r3", denoiser)]  # nothing to abort there
            stats = await n.stats()
            # r2 waiting for a decoder, r4 pushing, r5 in line.
            assert (stats.handoffs_in_flight, stats.prealloc[denoiser.instance]) == (3, PreallocCounts(0, 2))


async def test_an_input_the_size_of_the_receivers_region_is_allocated_there_not_made_to_wait(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """One slot, taken, and a 256-byte region: an input of exactly 256 bytes fits the region,
    so it is allocated there at once; made to wait for the slot, it would sit behind the
    request holding it. One byte more fits only the slot, and waits."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=1, pool_size=SLOT_SIZE + 256) as (n, encoder, denoiser):
            await stage_and_place(n, encoder, denoiser, "r1", NBYTES)
            assert pushes(n) == [("r1", POOL_BASE)]
            await stage_and_place(n, encoder, denoiser, "r2", 256)
            await stage_and_place(n, encoder, denoiser, "r3", 257)
            assert n.take("denoiser") == [Send(instance=denoiser.instance, order=Alloc(request_id="r2", nbytes=256))]
            stats = await n.stats()
            assert (stats.handoffs_in_flight, stats.fast_path, stats.slow_path) == (3, {}, {})  # none made yet


async def test_a_sender_leaving_with_a_push_into_a_slot_and_a_flight_waiting_for_it(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """r1 pushes into the only slot, r2 of the same encoder waits for it. An audit found the
    encoder's Leaving crashed the negotiator: r1's slot came back mid-eviction and went to
    r2, a push ordered from the worker just evicted."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=1, pool_size=SLOT_SIZE + 256) as (n, encoder, denoiser):
            for rid in ("r1", "r2"):
                await stage_and_place(n, encoder, denoiser, rid, NBYTES)
            assert pushes(n) == [("r1", POOL_BASE)]
            await encoder.report(Leaving())
            failed = {(await n.tracker.receive()).request_id for _ in range(2)}
            assert failed == {"r1", "r2"}
            stats = await n.stats()
            assert (stats.handoffs_in_flight, stats.handoffs_held) == (0, 0)
            assert stats.prealloc[denoiser.instance] == PreallocCounts(1, 1)
            assert pushes(n) == []


async def test_a_placement_at_a_receiver_evicted_meanwhile_is_asked_of_it_and_fails_there(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """The pool placed r1 just before the denoiser left. An audit found this crashed the
    negotiator (the receiver's memory record was gone); the order goes to its pool, which
    fails the request as its worker is lost."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=0) as (n, encoder, denoiser):
            await stage_encoder_output(n, encoder, "r1")
            await denoiser.report(Leaving())
            while (await n.stats()).prealloc.get(denoiser.instance) is not None:
                await anyio.sleep(0.01)
            n.inbox.post(Placed(job=job("r1", "denoiser"), instance=denoiser.instance))
            await n.stats()
            assert Send(instance=denoiser.instance, order=Alloc(request_id="r1", nbytes=NBYTES)) in n.take("denoiser")


# --------------------------------------------------------------------------- for contrast


async def test_successful_push_keeps_the_slot_as_the_receivers_input(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser):
            await push_on_fast_path(n, encoder, denoiser, "r1")
            await encoder.report(Pushed(request_id="r1", ok=True, transfer_ms=1.0))
            assert await n.pools["encoder"].receive() == released("r1", encoder, ok=True)
            handed = await n.tracker.receive()
            assert isinstance(handed, HandedOff) and (handed.request_id, handed.fast_path) == ("r1", True)
            assert await n.pools["denoiser"].receive() == Send(instance=denoiser.instance, order=Ready(
                request_id="r1", params=PARAMS, address=POOL_BASE, manifest=MANIFEST, slot_id=0))
            stats = await n.stats()
            assert stats.prealloc[denoiser.instance] == PreallocCounts(1, 2)
            assert stats.handoffs_in_flight == 0
            n.assert_silent()
            # Forgotten while the denoiser runs: its input slot goes back, and the denoiser
            # (now the flight's instance) is aborted, its pool slot held until the run ends.
            n.inbox.post(Forget(request_id="r1"))
            assert (await n.stats()).prealloc[denoiser.instance] == PreallocCounts(2, 2)
            assert n.take("denoiser") == stopped_while_running("r1", denoiser, ack=1)
            n.assert_silent()


async def test_forget_mid_push_keeps_the_slot_until_the_push_reports(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser):
            await push_on_fast_path(n, encoder, denoiser, "r1")
            n.inbox.post(Forget(request_id="r1"))
            stats = await n.stats()
            assert stats.prealloc[denoiser.instance] == PreallocCounts(1, 2)
            # Its request ended: no hand-off under way, one holding its receiver's memory.
            assert (stats.handoffs_in_flight, stats.handoffs_held) == (0, 1)
            assert n.take("encoder") == [
                released("r1", encoder),
                aborted("r1", encoder),
            ]
            assert n.take("denoiser") == [released("r1", denoiser)]
            await encoder.report(Pushed(request_id="r1", ok=True, transfer_ms=1.0))
            while (stats := await n.stats()).prealloc[denoiser.instance].free == 1:
                await anyio.sleep(0.005)
            assert stats.prealloc[denoiser.instance] == PreallocCounts(2, 2)
            assert (stats.handoffs_in_flight, stats.handoffs_held) == (0, 0)
            n.assert_silent()  # no Ready, no HandedOff, nothing released twice


async def refused(ctx: zmq.asyncio.Context, n: Negotiator, **register: Any) -> RegisterRefused:
    """Register with ``register`` overriding a valid denoiser's fields; expect a refusal."""
    fields = dict(protocol=PROTOCOL_VERSION, token=TOKEN, role="denoiser", name="w", work_address="ipc://unused",
                  session="s", pool_base=0, pool_size=4096, slots=[], capacity=1, write_timeout_s=5.0)
    before = (await n.stats()).prealloc
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(n.endpoint)
        await sock.send(encode(Register(**{**fields, **register})))
        reply = DAEMON_TO_WORKER.decode(await sock.recv())
    finally:
        sock.close(linger=0)
    assert isinstance(reply, RegisterRefused), reply
    assert (await n.stats()).prealloc == before  # nothing of it was taken in
    n.assert_silent()
    return reply


async def test_registration_with_a_wrong_token_is_refused(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """The fake workers above register for real: the token they carry is the one checked."""
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path) as n:
            assert (await refused(ctx, n, token="wrong")).message == (
                "bad token: this worker's daemon.token is not the daemon's")


async def test_slots_that_repeat_an_id_or_overlap_are_refused(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """Two records for one piece of memory would let two hand-offs land in it at once."""
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path) as n:
            same_id = [SlotInfo(slot_id=0, address=0, size=256), SlotInfo(slot_id=0, address=512, size=256)]
            overlapping = [SlotInfo(slot_id=0, address=0, size=512), SlotInfo(slot_id=1, address=256, size=256)]
            for slots in (same_id, overlapping):
                assert "overlap" in (await refused(ctx, n, slots=slots)).message


async def test_a_worker_of_another_model_is_refused(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """The registered encoder's model is the daemon's: a denoiser of another would be handed
    embeddings it cannot read."""
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path) as n, fake_worker(ctx, n, "encoder"):
            reply = await refused(ctx, n, model_digest="0123456789abcdef")
            assert "is not the model the registered workers serve" in reply.message and not reply.rejoin


async def test_a_worker_of_another_model_waits_for_the_eviction_of_silent_ones(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """The workers of the old model were killed (no Leaving) and those of the new one start
    before the daemon evicted them: refused for now, not for good; taken in after."""
    heartbeat_s = 0.05
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path, heartbeat_s=heartbeat_s, heartbeat_misses=3) as n:
            async with fake_worker(ctx, n, "encoder"):
                pass  # killed: silent from now on
            await anyio.sleep(3 * heartbeat_s)  # silent, not yet evicted
            reply = await refused(ctx, n, model_digest="0123456789abcdef")
            assert "is not the model the registered workers serve" in reply.message
            assert reply.rejoin and reply.deferred
            await anyio.sleep(2 * heartbeat_s)
            n.inbox.post(Tick())  # the eviction
            assert isinstance(await n.pools["encoder"].receive(), Leave)
            n.take("frontend")
            with ctx.socket(zmq.DEALER) as newcomer:
                newcomer.setsockopt(zmq.LINGER, 0)
                newcomer.connect(n.endpoint)
                await newcomer.send(encode(Register(
                    protocol=PROTOCOL_VERSION, token=TOKEN, role="denoiser", name="w", work_address="ipc://unused",
                    session="s", pool_base=0, pool_size=4096, slots=[], capacity=1, write_timeout_s=5.0,
                    model_digest="0123456789abcdef")))
                assert isinstance(DAEMON_TO_WORKER.decode(await newcomer.recv()), Registered)


@pytest.mark.parametrize(("register", "path"), [
    ({"capacity": 2000}, "$.capacity"),
    ({"capacity": 0}, "$.capacity"),  # a worker that could never be given work
    ({"slots": [SlotInfo(slot_id=0, address=0, size=0)]}, "$.slots[0].size"),  # a slot no input fits
], ids=["capacity past 1024", "no capacity", "empty slot"])
async def test_a_registration_the_wire_refuses_is_answered_naming_the_field(
    ctx: zmq.asyncio.Context, tmp_path: Path, register: dict[str, Any], path: str
) -> None:
    """Not silence: the worker would wait out its connect_timeout_s, then blame the daemon.
    Only a forged or broken worker sends these: the config refuses a capacity outside 1..1024."""
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path) as n:
            reply = await refused(ctx, n, **register)
            assert reply.message.startswith("unreadable registration:") and reply.message.endswith(f"`{path}`")


async def test_a_worker_of_another_protocol_version_is_told_so_whatever_its_register_lacks(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """A version-3 worker's Register lacks write_timeout_s, which version 4 requires: it was
    told its registration was unreadable, naming that field, not that it is of another build."""
    old = {"kind": "Register", "protocol": PROTOCOL_VERSION - 1, "token": TOKEN, "role": "denoiser", "name": "w",
           "work_address": "ipc://unused", "session": "s", "pool_base": 0, "pool_size": 4096, "slots": [],
           "capacity": 1}
    with anyio.fail_after(5), ctx.socket(zmq.DEALER) as sock:
        async with running_negotiator(ctx, tmp_path) as n:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(n.endpoint)
            await sock.send(msgspec.msgpack.encode(old))
            reply = DAEMON_TO_WORKER.decode(await sock.recv())
    assert reply == RegisterRefused(message=f"protocol {PROTOCOL_VERSION - 1}, daemon speaks {PROTOCOL_VERSION}")


async def test_a_stall_of_the_daemon_is_no_workers_silence(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """The daemon's loop stood still past heartbeat_misses (a SIGSTOP, a frozen VM): the
    heartbeats of that time wait unread, so nobody is evicted or suspected on waking. The
    silence that follows still counts."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2, heartbeat_s=0.1,
                                        heartbeat_misses=3) as (n, encoder, denoiser):
            time.sleep(0.5)  # the loop stands still: no reader, no tick
            n.inbox.post(Tick(gap_s=0.5))  # handled before the socket is read again
            await n.stats()
            n.assert_silent()
            await anyio.sleep(0.35)  # awake, and neither worker speaks: 3.5 heartbeats
            n.inbox.post(Tick())
            await n.stats()
            for worker, role in ((encoder, "encoder"), (denoiser, "denoiser")):
                assert [(type(mail), mail.instance) for mail in n.take(role)] == [(Leave, worker.instance)]


async def test_a_stall_of_the_daemon_does_not_make_a_push_in_flight_overdue(
    ctx: zmq.asyncio.Context, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its Pushed may wait unread in the socket with the heartbeats: the stall's time is
    added to every push's due time, or every sender with a push in flight would get no new
    work on waking."""
    monkeypatch.setattr(actors.handoffs, "PUSH_REPORT_GRACE_S", 0.0)
    monkeypatch.setattr(transfer.engine, "_GRACE_S", 0.0)
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2, write_timeout_s=0.5, heartbeat_s=0.1,
                                        heartbeat_misses=3) as (n, encoder, denoiser):
            await push_on_fast_path(n, encoder, denoiser, "r1")
            time.sleep(0.7)  # the loop stands still past the push's due time
            n.inbox.post(Tick(gap_s=0.7))
            await n.stats()
            assert Suspect(instance=encoder.instance, suspect=True) not in n.take("encoder")


async def test_a_stall_of_the_daemon_does_not_evict_a_receiver_a_push_just_failed_into(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Its heartbeats of the stall wait unread: evicted on waking, a denoiser would sit out
    push_quarantine_s before it could rejoin."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2, heartbeat_s=0.1,
                                        heartbeat_misses=3) as (n, encoder, denoiser):
            await fail_a_push_into(n, encoder, denoiser, "r1")
            time.sleep(0.5)  # the loop stands still: five heartbeats
            n.inbox.post(Tick(gap_s=0.5))
            await n.stats()
            n.assert_silent()


async def test_a_sender_whose_push_is_overdue_gets_no_new_work_until_it_reports_one(
    ctx: zmq.asyncio.Context, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's writes go one at a time, and one stuck on a peer that does not answer
    (Mooncake's handshake with a frozen one lasts a minute) holds every later one: work sent
    there would wait behind it. Its heartbeats say it lives, not that its pushes move: only
    a Pushed clears it."""
    monkeypatch.setattr(actors.handoffs, "PUSH_REPORT_GRACE_S", 0.0)
    monkeypatch.setattr(transfer.engine, "_GRACE_S", 0.0)
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2, write_timeout_s=0.5) as (n, encoder, denoiser):
            await push_on_fast_path(n, encoder, denoiser, "r1")
            await encoder.report(Heartbeat())
            n.inbox.post(Tick())
            await n.stats()
            assert n.take("encoder") == []  # not due yet (half a second is ample on a loaded host)
            await anyio.sleep(0.6)
            n.inbox.post(Tick())
            assert await n.pools["encoder"].receive() == Suspect(instance=encoder.instance, suspect=True)
            n.inbox.post(Tick())
            await encoder.report(Heartbeat())
            await n.stats()
            n.assert_silent()  # once, and a heartbeat does not lift it
            await encoder.report(Pushed(request_id="r1", ok=True, transfer_ms=60_000.0))
            assert [await n.pools["encoder"].receive() for _ in range(2)] == [
                released("r1", encoder, ok=True), Suspect(instance=encoder.instance, suspect=False)]
            n.inbox.post(Tick())
            await n.stats()
            assert Suspect(instance=encoder.instance, suspect=True) not in n.take("encoder")


async def test_a_sender_with_a_short_write_timeout_is_overdue_behind_a_push_due_later(
    ctx: zmq.asyncio.Context, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each sender's pushes are due by its own write timeout, so a push sent later can be
    due sooner: the check went by sending order and stopped at the first push not yet due,
    missing the stuck sender behind it (it kept getting work)."""
    monkeypatch.setattr(actors.handoffs, "PUSH_REPORT_GRACE_S", 0.0)
    monkeypatch.setattr(transfer.engine, "_GRACE_S", 0.0)
    with anyio.fail_after(5):
        async with (
            running_negotiator(ctx, tmp_path) as n,
            fake_worker(ctx, n, "encoder", write_timeout_s=30.0) as patient,
            fake_worker(ctx, n, "encoder", write_timeout_s=0.3, name="hasty") as hasty,
            fake_worker(ctx, n, "denoiser", slots=2) as denoiser,
        ):
            await push_on_fast_path(n, patient, denoiser, "r1")
            await stage_encoder_output(n, hasty, "r2")
            n.inbox.post(Placed(job=job("r2", "denoiser"), instance=denoiser.instance))
            await next_order(n, "encoder", Push)
            await anyio.sleep(0.4)
            n.inbox.post(Tick())
            assert await n.pools["encoder"].receive() == Suspect(instance=hasty.instance, suspect=True)
            await n.stats()
            n.assert_silent()  # the patient one is not due for half a minute


async def test_a_stopping_receiver_that_still_heartbeats_is_not_evicted_for_a_failed_push(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Stopping keeps it suspect (no new work), but its heartbeats say it is alive: evicting
    it would fail what it holds as worker_lost in the middle of a rolling restart."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2, heartbeat_s=0.2) as (n, encoder, denoiser):
            await denoiser.report(Stopping())
            assert await n.pools["denoiser"].receive() == suspected(denoiser)
            await push_on_fast_path(n, encoder, denoiser, "r1")
            await encoder.report(Pushed(request_id="r1", ok=False, transfer_ms=0.0, error="peer unreachable"))
            assert isinstance(await n.tracker.receive(), Failed)
            n.take("encoder")
            n.take("denoiser")
            for _ in range(4):  # 3.2 heartbeats after the failure, heard from every 0.8
                await anyio.sleep(0.16)
                await speak(n, denoiser)
                await speak(n, encoder)
                n.inbox.post(Tick())
            await n.stats()
            n.assert_silent()
            assert denoiser.instance in (await n.stats()).prealloc
