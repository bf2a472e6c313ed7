"""The Forget chain across real actors: admission -> encoder pool -> negotiator.

The test carries every mail between the actors by hand, so it chooses the interleaving (each
link stays FIFO, as the daemon's mailboxes are).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream

from actors.admission import AdmissionActor, AdmissionStats
from actors.base import ask_stats
from actors.mail import Dispatch, Enqueue, Forget, Join, Leave, Placed, Send, Suspect
from actors.mailbox import Mailbox, Switchboard
from actors.pools import PoolActor
from tests.actors.negotiator_harness import PARAMS, fake_worker, job, running_negotiator
from tests.actors.streams import open_stream, queued
from transfer.protocol import ROLES, Role, Work


async def settle(inbox: Mailbox[Any]) -> None:
    """Every mail posted to ``inbox`` so far has been handled."""
    await ask_stats(inbox)


def join_reached(c: Chain, instance: str, name: str, address: str) -> None:
    """An encoder of capacity 1 joins and is offered work (as once its Probe is answered)."""
    c.pool.post(Join(instance=instance, name=name, work_address=address, session="s", key=b"k" * 16, capacity=1))
    c.pool.post(Suspect(instance=instance, suspect=False))


async def settle_stats(c: Chain) -> AdmissionStats:
    return await ask_stats(c.admission)


@dataclass
class Chain:
    admission: Mailbox[Any]
    to_pools: dict[Role, MemoryObjectReceiveStream[Any]]  # what admission posts to each pool
    pool: Mailbox[Any]  # the real encoder pool's inbox
    pool_to_admission: MemoryObjectReceiveStream[Any]
    pool_to_tracker: MemoryObjectReceiveStream[Any]  # what the pool (and admission) post to the tracker
    pool_to_negotiator: MemoryObjectReceiveStream[Any]

    async def carry(self, src: MemoryObjectReceiveStream[Any], dst: Mailbox[Any]) -> list[Any]:
        mails = queued(src)
        for mail in mails:
            dst.post(mail)
        await settle(dst)
        return mails


@asynccontextmanager
async def running_chain(ctx: zmq.asyncio.Context) -> AsyncIterator[Chain]:
    async with AsyncExitStack() as stack:

        board = Switchboard()
        stream = partial(open_stream, stack, board)
        ad_inbox, pool_inbox = board.mailbox("admission", 32), board.mailbox("pool.encoder", 32)
        to_pools = {role: stream(f"pool.{role}") for role in ROLES}
        (pa_box, pa_rx), (pt_box, pt_rx), (pn_box, pn_rx) = stream("admission"), stream("tracker"), stream("negotiator")
        admission = AdmissionActor(ad_inbox, {role: box for role, (box, _) in to_pools.items()}, pt_box)
        pool = PoolActor("encoder", pool_inbox, ctx=ctx, policy="round_robin", send_hwm=100, admission=pa_box,
                         tracker=pt_box, negotiator=pn_box)
        async with anyio.create_task_group() as tg:
            await tg.start(admission.run)
            await tg.start(pool.run)
            yield Chain(ad_inbox, {role: rx for role, (_, rx) in to_pools.items()}, pool_inbox, pa_rx, pt_rx, pn_rx)
            tg.cancel_scope.cancel()


async def test_a_bounced_dispatch_does_not_restart_a_forgotten_request(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with (
            running_negotiator(ctx, tmp_path) as n,
            fake_worker(ctx, n, "encoder") as encoder,
            running_chain(ctx) as c,
        ):
            # An encoder of capacity 1 joins; its credit reaches admission.
            join_reached(c, "encoder-9", "old", f"ipc://{tmp_path}/old")
            await settle(c.pool)
            await c.carry(c.pool_to_admission, c.admission)
            # The tracker admits "r#0": admission dispatches it to the encoder pool at once...
            c.admission.post(Enqueue(job=job("r#0", "encoder")))
            await settle(c.admission)
            # ...but the pool hears first that its only instance was evicted...
            c.pool.post(Leave(instance="encoder-9", message="evicted"))
            await settle(c.pool)
            # ...and the request ends (its deadline, or the client cancels) before the pool
            # gets to the Dispatch: admission finds nothing queued and tells every pool.
            c.admission.post(Forget(request_id="r#0"))
            await settle(c.admission)
            assert await c.carry(c.to_pools["encoder"], c.pool) == [Dispatch(job=job("r#0", "encoder")),
                                                                    Forget(request_id="r#0")]
            # The pool bounced the Dispatch (Enqueue front + its credit back) and passed the Forget on.
            # It told the tracker nothing: the evicted encoder held no slot for "r#0", so there is
            # no Failed(worker_lost) to report, and a bounced job is requeued, not failed.
            await c.carry(c.pool_to_admission, c.admission)
            assert queued(c.pool_to_tracker) == []
            assert await c.carry(c.pool_to_negotiator, n.inbox) == [Forget(request_id="r#0")]

            # A new encoder joins (the restarted worker): its credit reaches admission.
            join_reached(c, encoder.instance, "new", f"ipc://{tmp_path}/new")
            await settle(c.pool)
            await c.carry(c.pool_to_admission, c.admission)
            await c.carry(c.to_pools["encoder"], c.pool)
            placed = await c.carry(c.pool_to_negotiator, n.inbox)
            await n.stats()

            # Expected: the ended request stays ended. Actual: it is placed and its work ordered.
            ordered = n.take("encoder")
            assert Send(instance=encoder.instance, order=Work(request_id="r#0", params=PARAMS)) not in ordered
            assert [m for m in placed if isinstance(m, Placed)] == []
            assert (await settle_stats(c)).queue_depths["encoder"] == 0
            assert queued(c.pool_to_tracker) == []  # nor is it reported on (queued, failed)
