"""Two races reported against the earlier design, replayed mail by mail; both are now impossible.

Race A (a receiver pool's slot never freed). The encoder's ``Staged`` makes the negotiator
enqueue the denoiser job just as the request fails. Admission forgets the request and tells
every pool, and only then receives the denoiser job and dispatches it: the denoiser pool sees
the ``Forget`` before the ``Dispatch``. Before, that pool held nothing at the ``Forget`` and
dropped it, then reserved a slot for the stale dispatch; if its ``Placed`` reached the
negotiator before the encoder pool's ``Forget`` did, the push went ahead, and nobody ever gave
the denoiser pool's slot back. Now every pool passes every ``Forget`` on (in order behind its
own ``Placed``), and whatever ends the flight releases the receiver's reservation.

Race C (a client's request id reused). The client's id used to name the request inside the
daemon too, so news about an ended request (its ``Forget`` still travelling, a stale
``Placed``, a push report) could be taken for a new request the client submitted under the
same id. Now each admission gets its own key (``"r#0"``, ``"r#1"``), never reused.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream

from actors.base import ask_stats
from actors.mail import Credit, Dispatch, Enqueue, Forget, HandedOff, Join, Placed, Release, Send, Suspect
from actors.mailbox import Mailbox, Switchboard
from actors.negotiator import PreallocCounts
from actors.pools import PoolActor, PoolStats
from tests.actors.negotiator_harness import (
    HOP,
    MANIFEST,
    NBYTES,
    PARAMS,
    POOL_BASE,
    SLOT_SIZE,
    FakeWorker,
    Negotiator,
    encoder_and_denoiser,
    fake_worker,
    job,
    push_on_fast_path,
    running_negotiator,
    stage_encoder_output,
)
from tests.actors.streams import open_stream, queued
from transfer.protocol import WORK_ORDER, Abort, Probe, Push, Pushed, Ready, Staged, Work

KEY = b"k" * 16


@dataclass
class RealPool:
    """A real PoolActor whose mail to and from the negotiator the test carries by hand."""

    inbox: Mailbox[Any]
    admission: MemoryObjectReceiveStream[Any]
    tracker: MemoryObjectReceiveStream[Any]
    negotiator: MemoryObjectReceiveStream[Any]
    work: zmq.asyncio.Socket  # the worker's end of the pool's PUSH socket

    async def stats(self) -> PoolStats:
        return await ask_stats(self.inbox)

    async def to_negotiator(self, n: Negotiator) -> list[Any]:
        """Carry everything this pool has posted to the negotiator so far, in order."""
        await self.stats()
        carried = queued(self.negotiator)
        for mail in carried:
            n.inbox.post(mail)
        await n.stats()
        return carried

    async def from_negotiator(self, n: Negotiator, role: str) -> list[Any]:
        """Carry everything the negotiator has posted to this pool so far, in order."""
        carried = n.take(role)
        for mail in carried:
            self.inbox.post(mail)
        await self.stats()
        return carried


@asynccontextmanager
async def real_pool(ctx: zmq.asyncio.Context, tmp_path: Path, worker: FakeWorker) -> AsyncIterator[RealPool]:
    """The denoiser pool, with ``worker``'s instance joined (as the negotiator's Join would have it)."""
    async with AsyncExitStack() as stack:

        board = Switchboard()
        stream = partial(open_stream, stack, board)
        inbox = board.mailbox("pool.denoiser", 32)
        (ad_box, ad_rx), (tr_box, tr_rx), (ng_box, ng_rx) = stream("admission"), stream("tracker"), stream("negotiator")
        work = stack.enter_context(ctx.socket(zmq.PULL))
        work.setsockopt(zmq.LINGER, 0)
        address = f"ipc://{tmp_path}/denoiser-work"
        work.bind(address)
        actor = PoolActor("denoiser", inbox, ctx=ctx, policy="round_robin", send_hwm=100, admission=ad_box,
                          tracker=tr_box, negotiator=ng_box)
        async with anyio.create_task_group() as tg:
            await tg.start(actor.run)
            inbox.post(Join(instance=worker.instance, name="denoiser-worker", work_address=address,
                            session=worker.session, key=KEY, capacity=2, fits=NBYTES))
            _, probe = await work.recv_multipart()
            assert WORK_ORDER.decode(probe) == Probe(instance=worker.instance)
            inbox.post(Suspect(instance=worker.instance, suspect=False))  # as the answered Probe has it
            assert await ad_rx.receive() == Credit(role="denoiser", delta=2)
            yield RealPool(inbox, ad_rx, tr_rx, ng_rx, work)
            tg.cancel_scope.cancel()


# --------------------------------------------------------------------------- race A


@pytest.mark.parametrize("forget_first", [True, False], ids=["forget-before-dispatch", "dispatch-before-forget"])
async def test_race_a_the_receiver_pools_slot_always_comes_back(
    forget_first: bool, ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with (
            encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser),
            real_pool(ctx, tmp_path, denoiser) as pool,
        ):
            await stage_encoder_output(n, encoder, "r#0")  # the denoiser job is on its way to admission
            # The request fails. Admission tells every pool, and dispatches the stale denoiser job
            # after (forget-before-dispatch: the old race) or before it did so.
            mails = [Forget(request_id="r#0"), Dispatch(job=job("r#0", "denoiser"))]
            for mail in mails if forget_first else reversed(mails):
                pool.inbox.post(mail)
            carried = await pool.to_negotiator(n)
            placed = Placed(job=job("r#0", "denoiser"), instance=denoiser.instance)
            assert carried == ([Forget(request_id="r#0"), placed] if forget_first else
                               [placed, Forget(request_id="r#0")])
            assert (await pool.stats()).instances[0].slots_free == 1
            # The encoder pool's copy of the Forget comes last (the slow one, in the old race).
            n.inbox.post(Forget(request_id="r#0"))
            await n.stats()

            assert Release(request_id="r#0", instance=denoiser.instance, ok=None) in \
                await pool.from_negotiator(n, "denoiser")
            assert await pool.admission.receive() == Credit(role="denoiser", delta=1)
            [inst] = (await pool.stats()).instances
            assert (inst.slots_free, inst.served, inst.failed) == (2, 0, 0)
            encoder_mail = n.take("encoder")
            assert encoder_mail[-2:] == [Release(request_id="r#0", instance=encoder.instance, ok=None),
                                         Send(instance=encoder.instance, order=Abort(request_id="r#0"))]
            if forget_first:
                # The flight ended before the Placed came: no push was ever ordered.
                assert encoder_mail == encoder_mail[-2:]
                assert (await n.stats()).prealloc[denoiser.instance] == PreallocCounts(2, 2)
            else:
                assert isinstance(encoder_mail[0].order, Push)  # the push went out before the Forget
                assert (await n.stats()).prealloc[denoiser.instance] == PreallocCounts(1, 2)
                await encoder.report(Pushed(request_id="r#0", ok=True, transfer_ms=1.0))
                while (await n.stats()).prealloc[denoiser.instance].free != 2:
                    await anyio.sleep(0.005)
            n.assert_silent()
            assert queued(pool.tracker) == []
            assert queued(pool.negotiator) == []
            assert queued(pool.admission) == []


# --------------------------------------------------------------------------- race C


async def test_race_c_a_stale_forget_leaves_the_reused_ids_new_request_alone(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """The client reused "r" at once; the first admission's Forget copies arrive after the second started."""
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path) as n, fake_worker(ctx, n, "encoder") as encoder:
            n.inbox.post(Placed(job=job("r#0", "encoder"), instance=encoder.instance))
            n.inbox.post(Forget(request_id="r#0"))  # the first copy ends "r#0"
            await n.stats()
            n.take("encoder")  # Work, Release, Abort of r#0
            n.inbox.post(Placed(job=job("r#1", "encoder"), instance=encoder.instance))
            assert await n.pools["encoder"].receive() == Send(instance=encoder.instance,
                                                              order=Work(request_id="r#1", params=PARAMS))
            for _ in range(2):  # the other pools' copies, late
                n.inbox.post(Forget(request_id="r#0"))
            await n.stats()
            n.assert_silent()  # nothing released or aborted for "r#1"
            await encoder.report(Staged(request_id="r#1", nbytes=NBYTES, manifest=MANIFEST, compute_ms=1.0))
            assert await n.admission.receive() == Enqueue(job=job("r#1", "denoiser"))
            assert (await n.stats()).late_reports == 0


async def test_race_c_a_stale_placed_does_not_reserve_for_the_new_request(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser):
            await stage_encoder_output(n, encoder, "r#0")
            n.inbox.post(Forget(request_id="r#0"))
            await n.stats()
            n.take("encoder")  # Release, Abort of r#0
            await stage_encoder_output(n, encoder, "r#1")  # the same client id, admitted again
            # The first admission's denoiser job was dispatched anyway; its Placed arrives now.
            n.inbox.post(Placed(job=job("r#0", "denoiser"), instance=denoiser.instance))
            await n.stats()
            assert n.take("denoiser") == [Release(request_id="r#0", instance=denoiser.instance, ok=None)]
            stats = await n.stats()
            assert stats.prealloc[denoiser.instance] == PreallocCounts(2, 2)
            assert (stats.handoffs_in_flight, stats.fast_path) == (1, {})  # "r#1" still awaits its own receiver
            n.assert_silent()
            n.inbox.post(Placed(job=job("r#1", "denoiser"), instance=denoiser.instance))
            assert await n.pools["encoder"].receive() == Send(instance=encoder.instance, order=Push(
                request_id="r#1", session=denoiser.session, address=POOL_BASE, nbytes=NBYTES))


async def test_race_c_the_old_push_report_frees_only_its_own_slot(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """"r#0" was forgotten mid-push; "r#1" pushes to the same receiver before "r#0"'s push reports."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser):
            await push_on_fast_path(n, encoder, denoiser, "r#0")  # into slot 0
            n.inbox.post(Forget(request_id="r#0"))
            await n.stats()
            n.take("encoder")
            n.take("denoiser")
            await stage_encoder_output(n, encoder, "r#1")
            n.inbox.post(Placed(job=job("r#1", "denoiser"), instance=denoiser.instance))
            assert await n.pools["encoder"].receive() == Send(instance=encoder.instance, order=Push(
                request_id="r#1", session=denoiser.session, address=POOL_BASE + SLOT_SIZE, nbytes=NBYTES))
            assert (await n.stats()).prealloc[denoiser.instance] == PreallocCounts(0, 2)

            await encoder.report(Pushed(request_id="r#0", ok=True, transfer_ms=1.0))
            while (stats := await n.stats()).prealloc[denoiser.instance].free != 1:
                await anyio.sleep(0.005)
            assert stats.handoffs_in_flight == 1  # "r#1" still pushing
            n.assert_silent()  # no Ready, no HandedOff for anyone

            await encoder.report(Pushed(request_id="r#1", ok=True, transfer_ms=1.0))
            assert await n.pools["encoder"].receive() == Release(request_id="r#1", instance=encoder.instance, ok=True)
            handed = await n.tracker.receive()
            assert isinstance(handed, HandedOff) and handed.request_id == "r#1"
            assert await n.pools["denoiser"].receive() == Send(instance=denoiser.instance, order=Ready(
                request_id="r#1", params=PARAMS, address=POOL_BASE + SLOT_SIZE, manifest=MANIFEST, slot_id=1))
            stats = await n.stats()
            assert stats.prealloc[denoiser.instance] == PreallocCounts(1, 2)  # slot 1: r#1's input
            assert (stats.fast_path, stats.late_reports) == ({HOP: 1}, 0)  # r#0 ended before its push reported
            n.assert_silent()
