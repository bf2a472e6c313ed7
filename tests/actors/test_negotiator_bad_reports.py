"""TransferNegotiator against a worker that holds the token but sends what no worker should:
each gets a typed refusal or is ignored, and the daemon's loop never dies of it."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio

from actors.mail import Enqueue, Failed, Leave, Placed, Send, Stuck, Tick
from actors.negotiator import PreallocCounts
from tests.actors.negotiator_harness import (
    MANIFEST,
    NBYTES,
    POOL_BASE,
    POOL_SIZE,
    SLOT_SIZE,
    aborted,
    decoding,
    encoder_and_denoiser,
    fake_worker,
    job,
    next_order,
    push_on_fast_path,
    registration,
    released,
    running_negotiator,
    stage_encoder_output,
    wait_late,
)
from tests.loop_watch import LoopWatch
from transfer.protocol import (
    DAEMON_TO_WORKER,
    Allocated,
    Done,
    Heartbeat,
    Leaving,
    Pushed,
    Ready,
    Reason,
    RegisterRefused,
    Staged,
    Step,
    TensorSpec,
    Work,
    encode,
)
from transfer.reports import REPORTS_PER_MESSAGE


@pytest.mark.parametrize(("address", "why"), [
    ("garbage", "is not tcp:// or ipc://"),
    ("tcp://no-port", "Invalid argument"),
    ("tcp://gpu-node-7.cluster.internal:5555", "names its host: the daemon dials only IP addresses"),
    ("ipc://" + "x" * 200, "File name too long"),
])
async def test_a_work_address_the_daemon_cannot_connect_to_is_refused_at_registration(
    ctx: zmq.asyncio.Context, tmp_path: Path, address: str, why: str
) -> None:
    """Before, the pool's connect raised inside the daemon's loop and took the daemon down."""
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path) as n:
            with ctx.socket(zmq.DEALER) as sock:
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(n.endpoint)
                await sock.send(encode(registration("encoder", "s", 0, work_address=address)))
                refused = DAEMON_TO_WORKER.decode(await sock.recv())
            assert isinstance(refused, RegisterRefused) and not refused.rejoin
            assert why in refused.message and address[:20] in refused.message
            n.assert_silent()  # no Join: the pool never sees it
            async with fake_worker(ctx, n, "encoder"):  # and the next worker registers
                pass


async def test_reports_after_a_leaving_in_the_same_message_are_about_nothing(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path) as n, fake_worker(ctx, n, "encoder") as encoder:
            await encoder.sock.send_multipart([encode(Leaving()), encode(Leaving()), encode(Step(
                request_id="nobody", step=0, steps=1))])
            leave = await n.pools["encoder"].receive()
            assert isinstance(leave, Leave) and leave.instance == encoder.instance
            stats = await n.stats()
            assert encoder.instance not in stats.prealloc and stats.late_reports == 0
            n.assert_withdrawn("encoder", encoder.instance)
            n.assert_silent()


async def test_a_message_is_read_up_to_its_report_limit(
    ctx: zmq.asyncio.Context, tmp_path: Path, logs: list[dict]
) -> None:
    """One message's reports are one batch of mail, which no admission bounds."""
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path) as n, fake_worker(ctx, n, "encoder") as encoder:
            step = encode(Step(request_id="nobody", step=0, steps=1))
            await encoder.sock.send_multipart([step] * (REPORTS_PER_MESSAGE + 50))
            await wait_late(n, REPORTS_PER_MESSAGE)
            await encoder.report(Step(request_id="nobody", step=0, steps=1))
            assert (await wait_late(n, REPORTS_PER_MESSAGE + 1)).late_reports == REPORTS_PER_MESSAGE + 1
            assert ([e for e in logs if e["event"] == "worker.too_many_reports"][0]["reports"]
                    == REPORTS_PER_MESSAGE + 50)


async def test_a_repeated_report_leaves_the_live_request_alone(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """A late report frees the reporter's memory for the request, unless the request still
    lives on that worker: there the memory is in use (a staged output awaiting its push, an
    allocation being written)."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=0) as (n, encoder, denoiser):
            await stage_encoder_output(n, encoder, "r1")
            await encoder.report(Staged(request_id="r1", nbytes=NBYTES, manifest=MANIFEST, compute_ms=1.0))
            n.inbox.post(Placed(job=job("r1", "denoiser"), instance=denoiser.instance))
            await n.pools["denoiser"].receive()  # Alloc
            allocated = Allocated(request_id="r1", address=POOL_BASE)
            await denoiser.report(allocated)
            await n.pools["encoder"].receive()  # Push
            await denoiser.report(allocated)
            assert (await wait_late(n, 2)).handoffs_in_flight == 1
            n.assert_silent()  # no Abort to either
            await encoder.report(Pushed(request_id="r1", ok=True, transfer_ms=1.0))
            ready = await n.pools["denoiser"].receive()
            assert isinstance(ready, Send) and isinstance(ready.order, Ready)
            # Late where the request no longer lives: the reporter is told to free its block.
            await encoder.report(Staged(request_id="r1", nbytes=NBYTES, manifest=MANIFEST, compute_ms=1.0))
            await wait_late(n, 3)
            assert aborted("r1", encoder) in n.take("encoder")


async def test_a_decoder_output_unlike_its_header_fails_the_request(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """The frames go to the client as they are: one that would not decode there fails here."""
    with anyio.fail_after(5):
        async with decoding(ctx, tmp_path, "r1") as (n, decoder):
            image = TensorSpec(name="image", dtype="uint8", shape=(2, 2, 3), nbytes=12)
            await decoder.sock.send_multipart([encode(Done(request_id="r1", ok=True, compute_ms=1.0,
                                                           outputs=[image])), b"x" * 11])
            failed = await n.tracker.receive()
            assert isinstance(failed, Failed) and failed.reason == Reason.STAGE_FAILED
            assert "frame has 11 bytes, header needs 12" in failed.message
            assert n.take("decoder") == [released("r1", decoder, ok=False), aborted("r1", decoder)]
            assert (await n.stats()).prealloc[decoder.instance] == PreallocCounts(1, 1)


async def test_an_output_no_receiver_could_ever_take_is_invalid_and_not_handed_off(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Nothing a retry could mend: the denoiser's pool past its two slots is the most it
    takes, and one byte more fails the request as ``invalid`` at once, its sender's staged
    output freed; the most it takes still goes on."""
    largest = POOL_SIZE - 2 * SLOT_SIZE
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser):
            async def staged(rid: str, nbytes: int) -> None:
                n.inbox.post(Placed(job=job(rid, "encoder"), instance=encoder.instance))
                await next_order(n, "encoder", Work)
                await encoder.report(Staged(request_id=rid, nbytes=nbytes, manifest=MANIFEST, compute_ms=1.0))

            await staged("too-big", largest + 1)
            assert await n.tracker.receive() == Failed(
                request_id="too-big", reason=Reason.INVALID, avoid=frozenset({encoder.instance}),
                message=f"its {largest + 1}-byte output fits no denoiser's memory pool "
                        f"(the most one ever registered takes is {largest} bytes: workers.denoiser.pool_bytes past its "
                        "preallocated slots, or prealloc_slot_bytes)")
            assert n.take("encoder") == [released("too-big", encoder, ok=True), aborted("too-big", encoder)]
            await staged("fits", largest)
            assert await n.admission.receive() == Enqueue(job=msgspec.structs.replace(job("fits", "denoiser"),
                                                                                  nbytes=largest))
            n.assert_silent()
            assert (await n.stats()).prealloc[denoiser.instance] == PreallocCounts(2, 2)


async def test_an_output_only_a_receiver_that_left_takes_waits_for_it(ctx: zmq.asyncio.Context,
                                                                       tmp_path: Path) -> None:
    """The big denoiser is restarting (it said Leaving): an output only it takes goes to the
    denoisers' queue, where it waits for it, not failed ``invalid`` as no denoiser's (an
    audit: a big receiver's restart failed every such request, the client told its request
    was bad). What no denoiser ever registered takes still fails at once."""
    big = POOL_SIZE - 2 * SLOT_SIZE
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser):
            async with fake_worker(ctx, n, "denoiser", name="small", slots=1, pool_size=2 * SLOT_SIZE):
                await denoiser.sock.send(encode(Leaving()))
                leave = await n.pools["denoiser"].receive()
                assert isinstance(leave, Leave) and leave.instance == denoiser.instance
                for rid, nbytes in (("waits", big), ("never", big + 1)):
                    n.inbox.post(Placed(job=job(rid, "encoder"), instance=encoder.instance))
                    await next_order(n, "encoder", Work)
                    await encoder.report(Staged(request_id=rid, nbytes=nbytes, manifest=MANIFEST, compute_ms=1.0))
                assert await n.admission.receive() == Enqueue(job=msgspec.structs.replace(job("waits", "denoiser"),
                                                                                      nbytes=big))
                failed = await n.tracker.receive()
                assert isinstance(failed, Failed) and (failed.request_id, failed.reason) == ("never", Reason.INVALID)
                assert failed.message.startswith(f"its {big + 1}-byte output fits no denoiser's memory pool (the "
                                                 f"most one ever registered takes is {big} bytes")


async def test_a_stuck_worker_is_evicted_once_and_may_still_be_finishing_a_write(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Its pool could not queue its orders (Stuck): evicted as silent, not dead, so memory it
    may still be writing into waits out the quarantine."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2, push_quarantine_s=30.0) as (n, encoder, denoiser):
            await push_on_fast_path(n, encoder, denoiser, "r1")
            stuck = Stuck(instance=encoder.instance, message=f"encoder {encoder.instance} is not taking work")
            n.inbox.post(stuck)
            leave = await n.pools["encoder"].receive()
            assert leave == Leave(instance=encoder.instance, message=stuck.message)
            n.assert_withdrawn("encoder", encoder.instance)
            failed = await n.tracker.receive()
            assert (failed.request_id, failed.reason) == ("r1", Reason.WORKER_LOST)
            assert n.take("encoder") == [released("r1", encoder), aborted("r1", encoder)]
            assert n.take("denoiser") == [released("r1", denoiser)]
            n.inbox.post(stuck)  # its pool's next flush said so again
            stats = await n.stats()
            assert encoder.instance not in stats.prealloc
            assert stats.prealloc[denoiser.instance] == PreallocCounts(1, 2)  # quarantined, not reused
            n.assert_silent()


async def test_a_late_report_from_a_quarantined_receiver_waits_for_its_memory_to_be_released(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Aborting it at once would free the allocation a push in doubt may still land in; it
    is aborted with that memory, at the quarantine's end, even on the fast path."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2, push_quarantine_s=0.2) as (n, encoder, denoiser):
            await push_on_fast_path(n, encoder, denoiser, "r1")
            await encoder.report(Pushed(request_id="r1", ok=False, transfer_ms=1.0, error="timed out", in_doubt=True))
            assert isinstance(await n.tracker.receive(), Failed)
            await denoiser.report(Staged(request_id="r1", nbytes=NBYTES, manifest=MANIFEST, compute_ms=1.0))
            await wait_late(n, 1)
            n.take("encoder")
            assert aborted("r1", denoiser) not in n.take("denoiser")
            await anyio.sleep(0.25)
            n.inbox.post(Tick())
            await n.stats()
            assert n.take("denoiser") == [aborted("r1", denoiser)]
            assert (await n.stats()).prealloc[denoiser.instance] == PreallocCounts(2, 2)


async def test_a_flood_of_junk_from_anyone_costs_a_few_log_lines(
    ctx: zmq.asyncio.Context, tmp_path: Path, logs: list[dict]
) -> None:
    """No token is needed to send junk to the worker socket: each is still answered, but a
    million of them must not become a million log lines."""
    with anyio.fail_after(10):
        async with running_negotiator(ctx, tmp_path) as n:
            with ctx.socket(zmq.DEALER) as junk:
                junk.connect(n.endpoint)
                for _ in range(500):
                    await junk.send(b"\xc1")
                for _ in range(500):
                    refused = DAEMON_TO_WORKER.decode(await junk.recv())
                    assert isinstance(refused, RegisterRefused) and "unreadable registration" in refused.message
            await n.stats()
            bad = [line for line in logs if line["event"] == "worker.bad_message"]
            assert len(bad) == 10


async def test_a_message_of_a_million_frames_never_holds_the_loop_for_long(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Anyone may connect to the worker socket, and its size limit is per frame: read whole,
    one message of a million empty frames held the daemon's loop (every socket and timer)
    for a second. Its rest is dropped a batch at a time instead."""
    loop = LoopWatch()
    with anyio.fail_after(20):
        async with running_negotiator(ctx, tmp_path) as n, anyio.create_task_group() as tg:
            tg.start_soon(loop.run)
            stranger = ctx.socket(zmq.DEALER)
            stranger.setsockopt(zmq.LINGER, 0)
            stranger.setsockopt(zmq.SNDHWM, 0)
            stranger.connect(n.endpoint)
            try:
                await stranger.send_multipart([encode(Heartbeat()), *[b""] * 1_000_000])
                refused = DAEMON_TO_WORKER.decode(await stranger.recv())
            finally:
                stranger.close(linger=0)
            tg.cancel_scope.cancel()
    assert isinstance(refused, RegisterRefused) and refused.rejoin
    assert loop.longest_gap < 0.1
