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
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.admission import AdmissionActor, AdmissionStats
from actors.base import ask_stats
from actors.mail import Dispatch, Enqueue, Forget, Join, Leave, Placed, Send
from actors.pools import PoolActor
from tests.actors.negotiator_harness import PARAMS, fake_worker, job, running_negotiator
from tests.actors.streams import open_stream, queued
from transfer.protocol import ROLES, Reason, Role, Work


async def settle(inbox: MemoryObjectSendStream[Any]) -> None:
    """Every mail sent to ``inbox`` so far has been handled."""
    await ask_stats(inbox)



async def settle_stats(c: Chain) -> AdmissionStats:
    return await ask_stats(c.admission)


@dataclass
class Chain:
    admission: MemoryObjectSendStream[Any]
    to_pools: dict[Role, MemoryObjectReceiveStream[Any]]  # what admission posts to each pool
    pool: MemoryObjectSendStream[Any]  # the real encoder pool's inbox
    pool_to_admission: MemoryObjectReceiveStream[Any]
    pool_to_tracker: MemoryObjectReceiveStream[Any]
    pool_to_negotiator: MemoryObjectReceiveStream[Any]

    async def carry(self, src: MemoryObjectReceiveStream[Any], dst: MemoryObjectSendStream[Any]) -> list[Any]:
        mails = queued(src)
        for mail in mails:
            await dst.send(mail)
        await settle(dst)
        return mails


@asynccontextmanager
async def running_chain(ctx: zmq.asyncio.Context) -> AsyncIterator[Chain]:
    async with AsyncExitStack() as stack:

        stream = partial(open_stream, stack)
        ad_tx, ad_rx = stream()
        to_pools = {role: stream() for role in ROLES}
        (pool_tx, pool_rx), (pa_tx, pa_rx), (pt_tx, pt_rx), (pn_tx, pn_rx) = stream(), stream(), stream(), stream()
        admission = AdmissionActor(ad_rx, {role: tx for role, (tx, _) in to_pools.items()})
        pool = PoolActor("encoder", pool_rx, ctx=ctx, policy="round_robin", send_hwm=100, admission=pa_tx,
                         tracker=pt_tx, negotiator=pn_tx)
        async with anyio.create_task_group() as tg:
            await tg.start(admission.run)
            await tg.start(pool.run)
            yield Chain(ad_tx, {role: rx for role, (_, rx) in to_pools.items()}, pool_tx, pa_rx, pt_rx, pn_rx)
            ad_tx.close()
            pool_tx.close()


async def test_a_bounced_dispatch_does_not_restart_a_forgotten_request(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with (
            running_negotiator(ctx, tmp_path) as n,
            fake_worker(ctx, n, "encoder") as encoder,
            running_chain(ctx) as c,
        ):
            # An encoder of capacity 1 joins; its credit reaches admission.
            await c.pool.send(Join(instance="encoder-9", name="old", work_address=f"ipc://{tmp_path}/old",
                                   session="s", key=b"k" * 16, capacity=1))
            await settle(c.pool)
            await c.carry(c.pool_to_admission, c.admission)
            # The tracker admits "r#0": admission dispatches it to the encoder pool at once...
            await c.admission.send(Enqueue(job=job("r#0", "encoder")))
            await settle(c.admission)
            # ...but the pool hears first that its only instance was evicted...
            await c.pool.send(Leave(instance="encoder-9", reason=Reason.WORKER_LOST, message="evicted"))
            await settle(c.pool)
            # ...and the request ends (its deadline, or the client cancels) before the pool
            # gets to the Dispatch: admission finds nothing queued and tells every pool.
            await c.admission.send(Forget(request_id="r#0"))
            await settle(c.admission)
            assert await c.carry(c.to_pools["encoder"], c.pool) == [Dispatch(job=job("r#0", "encoder")),
                                                                    Forget(request_id="r#0")]
            # The pool bounced the Dispatch (Enqueue front + its credit back) and passed the Forget on.
            await c.carry(c.pool_to_admission, c.admission)
            assert await c.carry(c.pool_to_negotiator, n.inbox) == [Forget(request_id="r#0")]

            # A new encoder joins (the restarted worker): its credit reaches admission.
            await c.pool.send(Join(instance=encoder.instance, name="new", work_address=f"ipc://{tmp_path}/new",
                                   session="s", key=b"k" * 16, capacity=1))
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
