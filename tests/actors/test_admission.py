"""AdmissionActor with fake pools: jobs wait for credit, then go out oldest first; a Forget
drops the request from the queues and passes on to every pool."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import msgspec
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream

from actors.admission import AdmissionActor, AdmissionStats
from actors.base import ask_stats
from actors.mail import AdmissionMail, Credit, Dispatch, Enqueue, Forget, Job, Queued
from actors.mailbox import Mailbox, Switchboard
from tests.actors.streams import open_stream, queued
from transfer.protocol import ROLES, GenParams, Role

PARAMS = GenParams(prompt="p")


@dataclass
class Admission:
    inbox: Mailbox[AdmissionMail]
    pools: dict[Role, MemoryObjectReceiveStream[Any]]
    tracker: MemoryObjectReceiveStream[Any]

    async def stats(self) -> AdmissionStats:
        """Ask for stats; the answer also proves every earlier mail was handled."""
        return await ask_stats(self.inbox)

    async def enqueue(self, *rids: str, role: Role = "encoder", front: bool = False) -> None:
        for rid in rids:
            self.inbox.post(Enqueue(job=job(rid, role), front=front))

    async def posted(self, role: Role = "encoder") -> list[Any]:
        """Every mail posted to ``role``'s pool so far, in order."""
        await self.stats()
        return queued(self.pools[role])

    async def dispatched(self, role: Role = "encoder") -> list[str]:
        """Request ids dispatched to ``role``'s pool so far, in order (and nothing else posted)."""
        out = []
        for mail in await self.posted(role):
            assert isinstance(mail, Dispatch) and mail.job.role == role, mail
            out.append(mail.job.request_id)
        return out


def job(rid: str, role: Role = "encoder", deadline: float = math.inf) -> Job:
    return Job(request_id=rid, role=role, params=PARAMS, deadline=deadline)


@asynccontextmanager
async def running_admission() -> AsyncIterator[Admission]:
    async with AsyncExitStack() as stack:
        board = Switchboard()
        inbox = board.mailbox("admission", 32)
        pools = {role: open_stream(stack, board, f"pool.{role}") for role in ROLES}
        tracker_box, tracker_rx = open_stream(stack, board, "tracker")
        actor = AdmissionActor(inbox, {role: box for role, (box, _) in pools.items()}, tracker_box)
        async with anyio.create_task_group() as tg:
            await tg.start(actor.run)
            yield Admission(inbox, {role: rx for role, (_, rx) in pools.items()}, tracker_rx)
            tg.cancel_scope.cancel()


async def test_jobs_wait_without_credit() -> None:
    with anyio.fail_after(5):
        async with running_admission() as a:
            await a.enqueue("r1", "r2")
            assert await a.dispatched() == []
            assert (await a.stats()).queue_depths["encoder"] == 2


async def test_credit_dispatches_that_many_jobs_oldest_first() -> None:
    with anyio.fail_after(5):
        async with running_admission() as a:
            await a.enqueue("r1", "r2", "r3")
            a.inbox.post(Credit(role="encoder", delta=2))
            assert await a.dispatched() == ["r1", "r2"]
            stats = await a.stats()
            assert (stats.queue_depths["encoder"], stats.credits["encoder"]) == (1, 0)


async def test_spare_credit_dispatches_a_later_job_at_once() -> None:
    with anyio.fail_after(5):
        async with running_admission() as a:
            a.inbox.post(Credit(role="encoder", delta=1))
            await a.enqueue("r1")
            assert await a.dispatched() == ["r1"]


@pytest.mark.parametrize("role", ROLES)
async def test_a_job_whose_deadline_passed_while_it_waited_is_dropped_not_dispatched(role: Role) -> None:
    """It is dropped when its turn comes, even before the tracker's tick ends it: no worker
    starts a request only to abort it. The credit goes to the next job in line."""
    with anyio.fail_after(5):
        async with running_admission() as a:
            a.inbox.post(Enqueue(job=job("late", role, deadline=time.monotonic())))
            await a.enqueue("r1", role=role)
            a.inbox.post(Credit(role=role, delta=2))
            assert await a.dispatched(role) == ["r1"]
            stats = await a.stats()
            assert (stats.queue_depths[role], stats.credits[role]) == (0, 1)
            a.inbox.post(Forget(request_id="late"))  # the tracker's, at its tick
            assert await a.posted(role) == [Forget(request_id="late")]
            assert (await a.stats()).credits[role] == 1


async def test_credit_is_per_role() -> None:
    with anyio.fail_after(5):
        async with running_admission() as a:
            await a.enqueue("e1", role="encoder")
            await a.enqueue("d1", role="denoiser")
            a.inbox.post(Credit(role="denoiser", delta=5))
            assert await a.dispatched("denoiser") == ["d1"]
            assert await a.dispatched("encoder") == []


async def test_forget_removes_a_queued_job() -> None:
    with anyio.fail_after(5):
        async with running_admission() as a:
            await a.enqueue("r1", "r2", "r3")
            a.inbox.post(Forget(request_id="r2"))
            assert (await a.stats()).queue_depths["encoder"] == 2
            a.inbox.post(Credit(role="encoder", delta=3))
            assert await a.posted() == [Forget(request_id="r2"), Dispatch(job=job("r1")), Dispatch(job=job("r3"))]
            assert (await a.stats()).credits["encoder"] == 1


async def test_forget_removes_the_job_from_whichever_role_queues_it() -> None:
    with anyio.fail_after(5):
        async with running_admission() as a:
            await a.enqueue("e1", role="encoder")
            await a.enqueue("d1", "d2", role="denoiser")
            a.inbox.post(Forget(request_id="d1"))
            assert (await a.stats()).queue_depths == {"encoder": 1, "denoiser": 1, "decoder": 0}


async def test_forget_is_forwarded_to_every_pool_after_removing_the_job() -> None:
    """Admission only knows queues: a dispatched request may be held by any pool, so each is told."""
    with anyio.fail_after(5):
        async with running_admission() as a:
            await a.enqueue("r1", role="denoiser")
            a.inbox.post(Forget(request_id="r1"))
            for role in ROLES:
                assert await a.posted(role) == [Forget(request_id="r1")]
            # Removed before it was passed on: credit arriving now finds nothing to dispatch.
            a.inbox.post(Credit(role="denoiser", delta=1))
            assert await a.dispatched("denoiser") == []
            assert (await a.stats()).queue_depths["denoiser"] == 0


async def test_forget_of_a_dispatched_request_follows_its_dispatch() -> None:
    """The pool sees the Dispatch before the Forget, so it can free the slot it reserved."""
    with anyio.fail_after(5):
        async with running_admission() as a:
            a.inbox.post(Credit(role="encoder", delta=1))
            await a.enqueue("r1")
            a.inbox.post(Forget(request_id="r1"))
            assert await a.posted("encoder") == [Dispatch(job=job("r1")), Forget(request_id="r1")]
            assert await a.posted("denoiser") == [Forget(request_id="r1")]
            assert await a.posted("decoder") == [Forget(request_id="r1")]


async def test_forget_of_an_unqueued_request_is_still_forwarded() -> None:
    with anyio.fail_after(5):
        async with running_admission() as a:
            await a.enqueue("r1")
            a.inbox.post(Forget(request_id="nobody"))
            assert (await a.stats()).queue_depths["encoder"] == 1
            for role in ROLES:
                assert await a.posted(role) == [Forget(request_id="nobody")]


async def test_enqueue_front_goes_first() -> None:
    with anyio.fail_after(5):
        async with running_admission() as a:
            await a.enqueue("r1", "r2")
            await a.enqueue("lost1", "lost2", front=True)  # bounced together, in this order
            a.inbox.post(Credit(role="encoder", delta=4))
            assert await a.dispatched() == ["lost1", "lost2", "r1", "r2"]


async def test_a_retrys_job_goes_first_as_a_bounced_one_does() -> None:
    """It waited its turn once: at every role, not only where it started again."""
    with anyio.fail_after(5):
        async with running_admission() as a:
            await a.enqueue("r1", role="denoiser")
            a.inbox.post(Enqueue(job=msgspec.structs.replace(job("retry", "denoiser"), again=True)))
            a.inbox.post(Credit(role="denoiser", delta=2))
            assert await a.dispatched("denoiser") == ["retry", "r1"]


async def test_negative_credit_holds_dispatch() -> None:
    """Credit lost with a departed worker must be paid back before anything else goes out."""
    with anyio.fail_after(5):
        async with running_admission() as a:
            await a.enqueue("r1", "r2")
            a.inbox.post(Credit(role="encoder", delta=-2))
            a.inbox.post(Credit(role="encoder", delta=1))
            assert await a.dispatched() == []
            a.inbox.post(Credit(role="encoder", delta=2))
            assert await a.dispatched() == ["r1"]
            assert (await a.stats()).credits["encoder"] == 0


async def test_stats_report_every_role() -> None:
    with anyio.fail_after(5):
        async with running_admission() as a:
            stats = await a.stats()
            assert stats.queue_depths == {role: 0 for role in ROLES}
            assert stats.credits == {role: 0 for role in ROLES}


async def test_a_higher_priority_job_goes_out_before_older_ones() -> None:
    with anyio.fail_after(5):
        async with running_admission() as a:
            await a.enqueue("old1", "old2")
            a.inbox.post(Enqueue(job=Job(request_id="urgent", role="encoder", params=PARAMS, deadline=math.inf,
                                         priority=5)))
            a.inbox.post(Credit(role="encoder", delta=2))
            assert await a.dispatched() == ["urgent", "old1"]


async def test_a_job_that_asked_for_progress_and_must_wait_hears_its_place_in_line() -> None:
    with anyio.fail_after(5):
        async with running_admission() as a:
            watched = partial(Job, role="denoiser", params=PARAMS, deadline=math.inf, progress=True)
            a.inbox.post(Credit(role="denoiser", delta=1))
            a.inbox.post(Enqueue(job=watched(request_id="first")))  # a free slot: no wait, no news
            a.inbox.post(Enqueue(job=watched(request_id="second")))
            a.inbox.post(Enqueue(job=job("unwatched", "denoiser")))  # did not ask: no news
            a.inbox.post(Enqueue(job=watched(request_id="third")))
            a.inbox.post(Enqueue(job=watched(request_id="urgent", priority=5)))
            assert await a.dispatched("denoiser") == ["first"]
            assert queued(a.tracker) == [Queued(request_id="second", role="denoiser", position=1),
                                 Queued(request_id="third", role="denoiser", position=3),
                                 Queued(request_id="urgent", role="denoiser", position=1)]
