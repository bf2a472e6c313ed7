"""PoolActor with fake peers and a fake worker (a PULL socket on ipc:// in tmp_path)."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream

from actors.base import ask_stats
from actors.mail import (
    Credit,
    Dispatch,
    Enqueue,
    Failed,
    Forget,
    Job,
    Join,
    Leave,
    Placed,
    PoolMail,
    Queued,
    Release,
    RunEnded,
    Send,
    Stuck,
    Suspect,
)
from actors.mailbox import Mailbox, Switchboard
from actors.pools import PoolActor, PoolStats
from tests.actors.streams import assert_empty, open_stream, queued
from transfer.protocol import (
    WORK_ORDER,
    Abort,
    Alloc,
    GenParams,
    Probe,
    Ready,
    Reason,
    Role,
    StageLimits,
    Work,
    WorkOrder,
)

PARAMS = GenParams(prompt="p")
KEY = b"k" * 16
ANY_REQUEST = StageLimits()


@dataclass
class Pool:
    role: Role
    inbox: Mailbox[PoolMail]
    admission: MemoryObjectReceiveStream[Any]
    tracker: MemoryObjectReceiveStream[Any]
    negotiator: MemoryObjectReceiveStream[Any]

    async def stats(self) -> PoolStats:
        """Ask for stats; the answer also proves every earlier mail was handled."""
        return await ask_stats(self.inbox)

    async def join(self, address: str, instance: str | None = None, capacity: int = 2, *,
                   work: Any = None, fits: int = 0, limits: StageLimits = ANY_REQUEST) -> str:
        """Join an instance and have it offered work, as once the negotiator hears its Probe
        arrived; ``work``: its work socket, to take the Probe off (tests that read orders)."""
        instance = instance or f"{self.role}-1"
        self.inbox.post(Join(instance=instance, name=f"w-{instance}", work_address=address, session="sess",
                             key=KEY, capacity=capacity, fits=fits, limits=limits))
        if work is not None:
            assert await next_order(work) == Probe(instance=instance)
        self.inbox.post(Suspect(instance=instance, suspect=False))
        assert await self.admission.receive() == Credit(role=self.role, delta=capacity)
        return instance

    async def dispatch(self, rid: str, nbytes: int = 0) -> str:
        """Dispatch ``rid`` and return the instance the negotiator is told it was placed at."""
        self.inbox.post(Dispatch(job=job(rid, self.role, nbytes=nbytes)))
        return await self.placed(rid, nbytes)

    async def placed(self, rid: str, nbytes: int = 0, priority: int = 0) -> str:
        """The instance the negotiator is told ``rid`` was placed at (the next mail it gets)."""
        placed = await self.negotiator.receive()
        assert isinstance(placed, Placed) and placed.job == job(rid, self.role, nbytes=nbytes, priority=priority)
        return placed.instance


def job(rid: str, role: Role = "encoder", *, nbytes: int = 0, priority: int = 0) -> Job:
    return Job(request_id=rid, role=role, params=PARAMS, deadline=math.inf, nbytes=nbytes, priority=priority)


@asynccontextmanager
async def running_pool(role: Role, ctx: zmq.Context, *, policy: str = "round_robin",
                       send_hwm: int = 100) -> AsyncIterator[Pool]:
    async with AsyncExitStack() as stack:

        board = Switchboard()
        stream = partial(open_stream, stack, board)
        inbox = board.mailbox(f"pool.{role}", 32)
        (ad_box, ad_rx), (tr_box, tr_rx), (ng_box, ng_rx) = stream("admission"), stream("tracker"), stream("negotiator")
        actor = PoolActor(role, inbox, ctx=ctx, policy=policy, send_hwm=send_hwm, admission=ad_box,
                          tracker=tr_box, negotiator=ng_box)
        async with anyio.create_task_group() as tg:
            await tg.start(actor.run)
            yield Pool(role, inbox, ad_rx, tr_rx, ng_rx)
            tg.cancel_scope.cancel()  # run is cancelled and closes the work sockets


@asynccontextmanager
async def fake_worker(ctx: zmq.asyncio.Context, tmp_path: Path, name: str = "w") -> AsyncIterator[tuple[str, Any]]:
    """A worker's work socket: PULL, bound before the pool connects its PUSH."""
    address = f"ipc://{tmp_path}/{name}"
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    try:
        yield address, sock
    finally:
        sock.close(linger=0)


@asynccontextmanager
async def joined_pool(role: Role, ctx: zmq.asyncio.Context, tmp_path: Path, capacity: int = 2) -> AsyncIterator[Pool]:
    """A pool of ``role`` that one worker (``{role}-1``, its work socket never read) joined."""
    async with fake_worker(ctx, tmp_path) as (address, _), running_pool(role, ctx) as pool:
        await pool.join(address, capacity=capacity)
        yield pool


async def next_order(sock: Any) -> WorkOrder:
    key, body = await sock.recv_multipart()
    assert key == KEY
    return WORK_ORDER.decode(body)


# --------------------------------------------------------------------------- membership


async def test_a_joined_instance_is_probed_and_offered_work_only_once_reached(
        ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with fake_worker(ctx, tmp_path) as (address, worker), running_pool("encoder", ctx) as pool:
            pool.inbox.post(Join(instance="encoder-1", name="w", work_address=address, session="s",
                                 key=KEY, capacity=3))
            assert await next_order(worker) == Probe(instance="encoder-1")
            [inst] = (await pool.stats()).instances
            assert (inst.slots_free, inst.slots_total, inst.suspect) == (3, 3, True)
            assert_empty(pool.admission)  # no credit: nothing may be dispatched to it yet
            pool.inbox.post(Dispatch(job=job("r1")))  # admission's credit from elsewhere
            assert await pool.admission.receive() == Enqueue(job=job("r1"), front=True)
            assert await pool.admission.receive() == Credit(role="encoder", delta=1)

            pool.inbox.post(Suspect(instance="encoder-1", suspect=False))  # its Probed came back
            assert await pool.admission.receive() == Credit(role="encoder", delta=3)
            assert await pool.dispatch("r1") == "encoder-1"


async def test_leave_fails_held_requests_with_worker_lost(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with joined_pool("encoder", ctx, tmp_path, capacity=3) as pool:
            await pool.dispatch("r1")
            await pool.dispatch("r2")
            pool.inbox.post(Leave(instance="encoder-1", message="missed heartbeats"))
            failed = [await pool.tracker.receive(), await pool.tracker.receive()]
            assert sorted(failed, key=lambda f: f.request_id) == [
                Failed(request_id=rid, reason=Reason.WORKER_LOST, message="missed heartbeats",
                       avoid=frozenset({"encoder-1"})) for rid in ("r1", "r2")
            ]
            assert await pool.admission.receive() == Credit(role="encoder", delta=-1)  # its one free slot
            assert (await pool.stats()).instances == []


async def test_leave_of_an_unknown_instance_does_nothing(ctx: zmq.asyncio.Context) -> None:
    with anyio.fail_after(5):
        async with running_pool("encoder", ctx) as pool:
            pool.inbox.post(Leave(instance="encoder-9", message="?"))
            await pool.stats()
            assert_empty(pool.admission)
            assert_empty(pool.tracker)


# --------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize("role", ["encoder", "denoiser", "decoder"])
async def test_dispatch_reserves_a_slot_and_tells_the_negotiator_without_sending(
    role: Role, ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Every role alike: the pool only reserves; the negotiator records the flight, then orders the work."""
    with anyio.fail_after(5):
        async with fake_worker(ctx, tmp_path) as (address, worker), running_pool(role, ctx) as pool:
            await pool.join(address, work=worker)
            pool.inbox.post(Dispatch(job=job("r1", role)))
            assert await pool.negotiator.receive() == Placed(job=job("r1", role), instance=f"{role}-1")
            [inst] = (await pool.stats()).instances
            assert inst.slots_free == 1
            pool.inbox.post(Send(instance=f"{role}-1", order=Abort(request_id="marker")))
            assert await next_order(worker) == Abort(request_id="marker")  # nothing came before it
            assert_empty(pool.admission)


async def test_negotiator_ordered_work_reaches_the_worker(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with fake_worker(ctx, tmp_path) as (address, worker), running_pool("encoder", ctx) as pool:
            await pool.join(address, work=worker)
            instance = await pool.dispatch("r1")
            pool.inbox.post(Send(instance=instance, order=Work(request_id="r1", params=PARAMS)))
            assert await next_order(worker) == Work(request_id="r1", params=PARAMS)


async def test_dispatch_with_no_instance_requeues_at_the_front_and_refunds(ctx: zmq.asyncio.Context) -> None:
    with anyio.fail_after(5):
        async with running_pool("encoder", ctx) as pool:
            pool.inbox.post(Dispatch(job=job("r1")))
            assert await pool.admission.receive() == Enqueue(job=job("r1"), front=True)
            assert await pool.admission.receive() == Credit(role="encoder", delta=1)
            await pool.stats()
            assert_empty(pool.admission)
            assert_empty(pool.negotiator)


async def test_dispatch_after_the_only_instance_left_requeues(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with joined_pool("encoder", ctx, tmp_path) as pool:
            pool.inbox.post(Leave(instance="encoder-1", message="gone"))
            assert await pool.admission.receive() == Credit(role="encoder", delta=-2)
            pool.inbox.post(Dispatch(job=job("r1")))
            assert await pool.admission.receive() == Enqueue(job=job("r1"), front=True)
            assert await pool.admission.receive() == Credit(role="encoder", delta=1)


async def test_bounced_dispatch_gives_its_credit_back(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """Credits the pool posts, less the dispatches it got, must equal its free slots.

    Admission spent a credit on the dispatch, and Leave already took that same slot's
    credit back; unless the bounce refunds one, a replacement worker starts a slot short
    (with capacity-1 workers, a queued job then waits for good).
    """
    with anyio.fail_after(5):
        async with joined_pool("encoder", ctx, tmp_path, capacity=1) as pool:
            # Its join credited +1, which admission spends on r1:
            pool.inbox.post(Leave(instance="encoder-1", message="gone"))
            pool.inbox.post(Dispatch(job=job("r1")))  # ...but the worker left first
            await pool.stats()
            credited = 1 + sum(mail.delta for mail in queued(pool.admission) if isinstance(mail, Credit))
            free = sum(i.slots_free for i in (await pool.stats()).instances)
            assert credited - 1 == free


async def test_dispatches_alternate_between_instances(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with (
            fake_worker(ctx, tmp_path, "a") as (address_a, _),
            fake_worker(ctx, tmp_path, "b") as (address_b, _),
            running_pool("decoder", ctx) as pool,
        ):
            await pool.join(address_a, "decoder-1")
            await pool.join(address_b, "decoder-2")
            assert [await pool.dispatch(f"r{i}") for i in range(4)] == ["decoder-1", "decoder-2"] * 2


# --------------------------------------------------------------------------- unequal memory

SMALL, LARGE = 4096, 65536  # the largest input each of two decoders can take


@asynccontextmanager
async def unequal_decoders(ctx: zmq.asyncio.Context, tmp_path: Path, *, policy: str = "round_robin",
                           large_capacity: int = 1) -> AsyncIterator[Pool]:
    """decoder-1 takes inputs up to SMALL bytes (capacity 2), decoder-2 up to LARGE."""
    async with (
        fake_worker(ctx, tmp_path, "a") as (address_a, _),
        fake_worker(ctx, tmp_path, "b") as (address_b, _),
        running_pool("decoder", ctx, policy=policy) as pool,
    ):
        await pool.join(address_a, "decoder-1", fits=SMALL)
        await pool.join(address_b, "decoder-2", capacity=large_capacity, fits=LARGE)
        yield pool


async def left_waiting(pool: Pool, rid: str, priority: int = 0, *, progress: bool = False,
                       deadline: float = math.inf) -> None:
    """Dispatch a LARGE job while decoder-2 is full: not placed, not sent back to the queue,
    it waits in the pool, and admission gets its slot back for jobs decoder-1 can take."""
    pool.inbox.post(Dispatch(job=msgspec.structs.replace(job(rid, "decoder", nbytes=LARGE, priority=priority),
                                                         progress=progress, deadline=deadline)))
    assert await pool.admission.receive() == Credit(role="decoder", delta=1)


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "power_of_two"])
async def test_a_job_goes_only_to_an_instance_whose_memory_can_hold_its_input(
    policy: str, ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Before, the pool picked by free slots alone: an input larger than the picked worker's
    memory failed its hand-off (transfer_failed) though another worker had room for it."""
    with anyio.fail_after(5):
        async with unequal_decoders(ctx, tmp_path, policy=policy, large_capacity=3) as pool:
            assert [await pool.dispatch(f"large{i}", LARGE) for i in range(3)] == ["decoder-2"] * 3
            assert await pool.dispatch("small", SMALL) == "decoder-1"  # as large as it takes


async def test_a_retry_avoiding_the_only_instance_that_can_hold_its_input_still_goes_there(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Avoiding a worker is a preference; not fitting one is a fact."""
    with anyio.fail_after(5):
        async with unequal_decoders(ctx, tmp_path) as pool:
            retry = msgspec.structs.replace(job("r1", "decoder", nbytes=LARGE), avoid=frozenset({"decoder-2"}))
            pool.inbox.post(Dispatch(job=retry))
            assert await pool.negotiator.receive() == Placed(job=retry, instance="decoder-2")


async def test_a_job_only_a_busy_instance_can_hold_waits_for_it_and_its_slot_serves_the_rest(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with unequal_decoders(ctx, tmp_path) as pool:
            assert await pool.dispatch("large1", LARGE) == "decoder-2"
            await left_waiting(pool, "large2")
            stats = await pool.stats()
            assert stats.waiting == 1 and [i.slots_free for i in stats.instances] == [2, 0]
            assert_empty(pool.negotiator)
            assert await pool.dispatch("small", SMALL) == "decoder-1"
            # The large decoder's slot frees: the waiting job takes it, admission never sees it.
            pool.inbox.post(Release(request_id="large1", instance="decoder-2", ok=True))
            assert await pool.placed("large2", LARGE) == "decoder-2"
            assert (await pool.stats()).waiting == 0
            assert_empty(pool.admission)
            pool.inbox.post(Release(request_id="large2", instance="decoder-2", ok=True))
            assert await pool.admission.receive() == Credit(role="decoder", delta=1)


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "power_of_two"])
async def test_a_job_goes_only_to_an_instance_whose_limits_take_it(policy: str, ctx: zmq.asyncio.Context,
                                                                   tmp_path: Path) -> None:
    """A decoder capped at 64 pixels a side joined after 256-pixel requests were let in (the
    door checks the workers registered then): they were sent to it too, and failed there
    ``invalid`` though the other decoder took them (an audit). They go to the other one, or
    wait for one that takes them."""
    large = msgspec.structs.replace(job("large", "decoder"), params=GenParams(prompt="p", width=256, height=256))
    with anyio.fail_after(5):
        async with (
            fake_worker(ctx, tmp_path, "a") as (address_a, _),
            fake_worker(ctx, tmp_path, "b") as (address_b, _),
            running_pool("decoder", ctx, policy=policy) as pool,
        ):
            await pool.join(address_a, "decoder-1", capacity=1)
            await pool.join(address_b, "capped", capacity=3, limits=StageLimits(max_size=64))
            for i in range(2):
                rid = f"large{i}"
                pool.inbox.post(Dispatch(job=msgspec.structs.replace(large, request_id=rid)))
            assert await pool.negotiator.receive() == Placed(job=msgspec.structs.replace(large, request_id="large0"),
                                                             instance="decoder-1")
            # decoder-1 is full: the second waits for it, though "capped" has three free slots.
            assert await pool.admission.receive() == Credit(role="decoder", delta=1)
            assert (await pool.stats()).waiting == 1
            assert await pool.dispatch("small") == "capped"
            pool.inbox.post(Release(request_id="large0", instance="decoder-1", ok=True))
            assert await pool.negotiator.receive() == Placed(job=msgspec.structs.replace(large, request_id="large1"),
                                                             instance="decoder-1")


async def test_waiting_jobs_go_by_priority_then_age_and_a_forgotten_one_leaves(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with unequal_decoders(ctx, tmp_path) as pool:
            assert await pool.dispatch("busy", LARGE) == "decoder-2"
            for rid, priority in [("old", 0), ("gone", 9), ("young", 0), ("urgent", 5)]:
                await left_waiting(pool, rid, priority)
            pool.inbox.post(Forget(request_id="gone"))
            assert await pool.negotiator.receive() == Forget(request_id="gone")
            for held, taker, priority in [("busy", "urgent", 5), ("urgent", "old", 0), ("old", "young", 0)]:
                pool.inbox.post(Release(request_id=held, instance="decoder-2", ok=True))
                assert await pool.placed(taker, LARGE, priority=priority) == "decoder-2"
            assert (await pool.stats()).waiting == 0


async def test_a_freed_slot_skips_a_waiting_job_whose_deadline_passed(ctx: zmq.asyncio.Context,
                                                                    tmp_path: Path) -> None:
    """The tracker is about to end it (its Forget takes it out of the line): started now, it
    would hold the slot, and a hand-off, for a request nobody waits for, ahead of a live one."""
    with anyio.fail_after(5):
        async with unequal_decoders(ctx, tmp_path) as pool:
            assert await pool.dispatch("busy", LARGE) == "decoder-2"
            await left_waiting(pool, "expired", deadline=time.monotonic())  # older: first in line, were it live
            await left_waiting(pool, "live")
            pool.inbox.post(Release(request_id="busy", instance="decoder-2", ok=True))
            assert await pool.placed("live", LARGE) == "decoder-2"
            assert (await pool.stats()).waiting == 1  # the expired one, until its Forget
            assert_empty(pool.negotiator)


async def test_a_waiting_job_that_asked_for_progress_is_told_its_place_among_the_waiting(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with unequal_decoders(ctx, tmp_path) as pool:
            assert await pool.dispatch("busy", LARGE) == "decoder-2"
            await left_waiting(pool, "quiet")  # asked for no progress: nothing said
            assert_empty(pool.tracker)
            await left_waiting(pool, "watched", progress=True)
            assert await pool.tracker.receive() == Queued(request_id="watched", role="decoder", position=2)
            await left_waiting(pool, "urgent", priority=5, progress=True)
            assert await pool.tracker.receive() == Queued(request_id="urgent", role="decoder", position=1)


async def test_an_instance_trusted_again_serves_the_waiting_jobs_before_admission(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with unequal_decoders(ctx, tmp_path, large_capacity=3) as pool:
            pool.inbox.post(Suspect(instance="decoder-2", suspect=True))
            assert await pool.admission.receive() == Credit(role="decoder", delta=-3)
            await left_waiting(pool, "large")
            pool.inbox.post(Suspect(instance="decoder-2", suspect=False))
            assert await pool.placed("large", LARGE) == "decoder-2"
            assert await pool.admission.receive() == Credit(role="decoder", delta=2)  # what it has left


# --------------------------------------------------------------------------- suspects


async def test_a_suspect_gets_no_work_and_its_free_slots_leave_admissions_count(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with (
            fake_worker(ctx, tmp_path, "a") as (address_a, _),
            fake_worker(ctx, tmp_path, "b") as (address_b, _),
            running_pool("denoiser", ctx) as pool,
        ):
            await pool.join(address_a, "denoiser-1", capacity=3)
            await pool.join(address_b, "denoiser-2", capacity=3)
            assert await pool.dispatch("r1") == "denoiser-1"
            pool.inbox.post(Suspect(instance="denoiser-1", suspect=True))
            assert await pool.admission.receive() == Credit(role="denoiser", delta=-2)
            pool.inbox.post(Suspect(instance="denoiser-1", suspect=True))  # said twice: counted once
            assert [await pool.dispatch(f"r{i}") for i in range(2, 5)] == ["denoiser-2"] * 3
            # Its held slot comes back, but not to admission while it is suspected.
            pool.inbox.post(Release(request_id="r1", instance="denoiser-1", ok=False))
            [one, _] = (await pool.stats()).instances
            assert (one.instance, one.slots_free, one.suspect) == ("denoiser-1", 3, True)
            assert_empty(pool.admission)
            pool.inbox.post(Suspect(instance="denoiser-1", suspect=False))
            assert await pool.admission.receive() == Credit(role="denoiser", delta=3)
            assert await pool.dispatch("r5") == "denoiser-1"


async def test_a_suspect_that_leaves_withdraws_nothing_twice(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with joined_pool("denoiser", ctx, tmp_path, capacity=3) as pool:
            await pool.dispatch("r1")
            pool.inbox.post(Suspect(instance="denoiser-1", suspect=True))
            assert await pool.admission.receive() == Credit(role="denoiser", delta=-2)
            pool.inbox.post(Leave(instance="denoiser-1", message="went silent"))
            assert await pool.tracker.receive() == Failed(request_id="r1", reason=Reason.WORKER_LOST,
                                                          message="went silent", avoid=frozenset({"denoiser-1"}))
            assert (await pool.stats()).instances == []
            assert_empty(pool.admission)


# --------------------------------------------------------------------------- release and forget


@pytest.mark.parametrize(("ok", "counted"), [(True, (1, 0)), (False, (0, 1)), (None, (0, 0))],
                         ids=["served", "failed", "unused"])
async def test_release_gives_the_slot_back_and_credits_admission(
    ctx: zmq.asyncio.Context, tmp_path: Path, ok: bool | None, counted: tuple[int, int]
) -> None:
    """The slot is counted (served, failed) as ``ok`` says: ok=None is a reservation handed
    back unused (its request ended before it was placed), counted neither. A second Release
    of it changes nothing."""
    with anyio.fail_after(5):
        async with joined_pool("denoiser", ctx, tmp_path) as pool:
            await pool.dispatch("r1")
            pool.inbox.post(Release(request_id="r1", instance="denoiser-1", ok=ok))
            assert await pool.admission.receive() == Credit(role="denoiser", delta=1)
            [inst] = (await pool.stats()).instances
            assert (inst.slots_free, inst.served, inst.failed) == (2, *counted)
            pool.inbox.post(Release(request_id="r1", instance="denoiser-1", ok=True))  # a second one
            [inst] = (await pool.stats()).instances
            assert (inst.slots_free, inst.served, inst.failed) == (2, *counted)
            assert_empty(pool.admission)


async def test_a_run_that_outlives_its_request_holds_its_slot_until_it_ends(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Release(finishing=True): the request lets go, its run does not. The slot is neither
    offered nor credited until RunEnded, and the request id is free for a new request."""
    with anyio.fail_after(5):
        async with joined_pool("denoiser", ctx, tmp_path, capacity=1) as pool:
            await pool.dispatch("r1")
            pool.inbox.post(Release(request_id="r1", instance="denoiser-1", ok=None, finishing=True))
            [inst] = (await pool.stats()).instances
            assert (inst.slots_free, inst.slots_finishing) == (0, 1)
            assert_empty(pool.admission)
            pool.inbox.post(RunEnded(instance="denoiser-1"))
            assert await pool.admission.receive() == Credit(role="denoiser", delta=1)
            await pool.dispatch("r1")  # the id again, a new request: held as any other
            pool.inbox.post(RunEnded(instance="denoiser-1"))  # none owed: nothing to give back
            pool.inbox.post(RunEnded(instance="denoiser-9"))
            [inst] = (await pool.stats()).instances
            assert (inst.slots_free, inst.slots_finishing) == (0, 0)
            assert_empty(pool.admission)


async def test_release_from_another_instance_is_ignored(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with joined_pool("denoiser", ctx, tmp_path) as pool:
            await pool.dispatch("r1")
            pool.inbox.post(Release(request_id="r1", instance="denoiser-7", ok=True))
            [inst] = (await pool.stats()).instances
            assert inst.slots_free == 1
            assert_empty(pool.admission)


async def test_release_of_an_unheld_request_is_ignored(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with joined_pool("denoiser", ctx, tmp_path) as pool:
            pool.inbox.post(Release(request_id="nobody", instance="denoiser-1", ok=False))
            [inst] = (await pool.stats()).instances
            assert (inst.slots_free, inst.served, inst.failed) == (2, 0, 0)
            assert_empty(pool.admission)


async def test_forget_of_a_running_request_only_tells_the_negotiator(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """The pool neither aborts nor frees on Forget: the negotiator ends the flight and says what to free."""
    with anyio.fail_after(5):
        async with fake_worker(ctx, tmp_path) as (address, worker), running_pool("encoder", ctx) as pool:
            await pool.join(address, work=worker)
            await pool.dispatch("r1")
            pool.inbox.post(Send(instance="encoder-1", order=Work(request_id="r1", params=PARAMS)))
            pool.inbox.post(Forget(request_id="r1"))
            assert await pool.negotiator.receive() == Forget(request_id="r1")
            [inst] = (await pool.stats()).instances
            assert inst.slots_free == 1  # still held
            assert_empty(pool.admission)
            pool.inbox.post(Send(instance="encoder-1", order=Abort(request_id="marker")))
            assert await next_order(worker) == Work(request_id="r1", params=PARAMS)
            assert await next_order(worker) == Abort(request_id="marker")  # no Abort of r1 of its own
            # The negotiator's answer to the Forget: an abort, then the slot back.
            pool.inbox.post(Send(instance="encoder-1", order=Abort(request_id="r1")))
            pool.inbox.post(Release(request_id="r1", instance="encoder-1", ok=None))
            assert await next_order(worker) == Abort(request_id="r1")
            assert await pool.admission.receive() == Credit(role="encoder", delta=1)
            [inst] = (await pool.stats()).instances
            assert (inst.slots_free, inst.served, inst.failed) == (2, 0, 0)


async def test_forget_of_a_reserved_slot_keeps_it_until_released(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with fake_worker(ctx, tmp_path) as (address, worker), running_pool("denoiser", ctx) as pool:
            await pool.join(address, work=worker)
            await pool.dispatch("r1")
            pool.inbox.post(Forget(request_id="r1"))
            assert await pool.negotiator.receive() == Forget(request_id="r1")
            [inst] = (await pool.stats()).instances
            assert inst.slots_free == 1
            assert_empty(pool.admission)
            pool.inbox.post(Send(instance="denoiser-1", order=Abort(request_id="marker")))
            assert await next_order(worker) == Abort(request_id="marker")  # nothing went to the worker before
            pool.inbox.post(Release(request_id="r1", instance="denoiser-1", ok=None))
            assert await pool.admission.receive() == Credit(role="denoiser", delta=1)
            assert (await pool.stats()).instances[0].slots_free == 2


async def test_forget_of_an_unheld_request_is_forwarded(ctx: zmq.asyncio.Context) -> None:
    with anyio.fail_after(5):
        async with running_pool("encoder", ctx) as pool:
            pool.inbox.post(Forget(request_id="nobody"))
            assert await pool.negotiator.receive() == Forget(request_id="nobody")
            await pool.stats()
            assert_empty(pool.admission)
            assert_empty(pool.tracker)


async def test_every_forget_is_forwarded_after_the_placed_before_it(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Admission tells every pool; each passes every Forget on, in order behind its own Placed mail."""
    with anyio.fail_after(5):
        async with joined_pool("denoiser", ctx, tmp_path, capacity=3) as pool:
            pool.inbox.post(Dispatch(job=job("held", "denoiser")))
            pool.inbox.post(Dispatch(job=job("released", "denoiser")))
            for rid in ("released", "elsewhere", "held"):
                if rid == "released":
                    pool.inbox.post(Release(request_id=rid, instance="denoiser-1", ok=True))
                pool.inbox.post(Forget(request_id=rid))
            await pool.stats()
            assert queued(pool.negotiator) == [
                Placed(job=job("held", "denoiser"), instance="denoiser-1"),
                Placed(job=job("released", "denoiser"), instance="denoiser-1"),
                Forget(request_id="released"),
                Forget(request_id="elsewhere"),
                Forget(request_id="held"),
            ]
            [inst] = (await pool.stats()).instances
            assert (inst.slots_free, inst.served) == (2, 1)  # "held" keeps its slot until released


async def test_forget_before_a_dispatch_leaves_the_slot_for_the_negotiator_to_release(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Race A, pool side: the Forget passes this pool before the request's (stale) Dispatch.

    The pool reserves the slot anyway and reports it; the negotiator, whose flight already
    ended, hands it back with Release(ok=None), and the slot count is full again.
    """
    with anyio.fail_after(5):
        async with joined_pool("denoiser", ctx, tmp_path) as pool:
            pool.inbox.post(Forget(request_id="r1"))
            assert await pool.negotiator.receive() == Forget(request_id="r1")
            assert await pool.dispatch("r1") == "denoiser-1"
            assert (await pool.stats()).instances[0].slots_free == 1
            pool.inbox.post(Release(request_id="r1", instance="denoiser-1", ok=None))
            assert await pool.admission.receive() == Credit(role="denoiser", delta=1)
            [inst] = (await pool.stats()).instances
            assert (inst.slots_free, inst.served, inst.failed) == (2, 0, 0)


async def test_every_order_is_sent_held_or_not(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """The pool sends whatever the negotiator orders; whether the request still lives is not its call."""
    with anyio.fail_after(5):
        async with fake_worker(ctx, tmp_path) as (address, worker), running_pool("encoder", ctx) as pool:
            await pool.join(address, work=worker)
            await pool.dispatch("r1")
            pool.inbox.post(Forget(request_id="r1"))
            assert await pool.negotiator.receive() == Forget(request_id="r1")
            orders = [Work(request_id="r1", params=PARAMS), Work(request_id="never", params=PARAMS),
                      Ready(request_id="r2", params=PARAMS, address=4096, manifest=[]),
                      Abort(request_id="late")]
            for order in orders:
                pool.inbox.post(Send(instance="encoder-1", order=order))
            assert [await next_order(worker) for _ in orders] == orders
            [inst] = (await pool.stats()).instances
            assert inst.slots_free == 1  # sending takes and frees nothing
            assert_empty(pool.tracker)
            assert_empty(pool.admission)
            assert_empty(pool.negotiator)


async def test_plain_send_for_an_unheld_request_still_goes_out(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """The negotiator's Aborts for late reports must reach the worker."""
    with anyio.fail_after(5):
        async with fake_worker(ctx, tmp_path) as (address, worker), running_pool("encoder", ctx) as pool:
            await pool.join(address, work=worker)
            pool.inbox.post(Send(instance="encoder-1", order=Abort(request_id="late")))
            assert await next_order(worker) == Abort(request_id="late")


# --------------------------------------------------------------------------- sends


async def test_send_to_a_departed_instance_fails_the_request(ctx: zmq.asyncio.Context) -> None:
    with anyio.fail_after(5):
        async with running_pool("decoder", ctx) as pool:
            pool.inbox.post(Send(instance="decoder-3", order=Alloc(request_id="r1", nbytes=10)))
            failed = await pool.tracker.receive()
            assert (failed.request_id, failed.reason) == ("r1", Reason.WORKER_LOST)


async def test_abort_to_a_departed_instance_is_dropped(ctx: zmq.asyncio.Context) -> None:
    with anyio.fail_after(5):
        async with running_pool("decoder", ctx) as pool:
            pool.inbox.post(Send(instance="decoder-3", order=Abort(request_id="r1")))
            await pool.stats()
            assert_empty(pool.tracker)


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
async def test_a_stuck_worker_is_reported_to_the_negotiator_and_the_loop_never_blocks(
    kind: str, tmp_path: Path
) -> None:
    """A worker whose queue is full (SNDHWM) takes no orders: the negotiator evicts it, which
    fails its requests, and its rejoin frees what a lost Abort would have.

    The daemon hands pools a ``zmq.asyncio.Context``, whose own sockets would report a full
    queue on the returned Future instead of raising ``zmq.Again``, so the check must hold
    for both kinds.
    """
    ctx = zmq.Context() if kind == "sync" else zmq.asyncio.Context()
    try:
        with anyio.fail_after(5):
            async with running_pool("encoder", ctx, send_hwm=1) as pool:
                # Nobody listens at this address, so the Probe fills the queue.
                await pool.join(f"ipc://{tmp_path}/nobody", capacity=3)
                instance = await pool.dispatch("r1")
                pool.inbox.post(Send(instance=instance, order=Work(request_id="r1", params=PARAMS)))
                await pool.stats()  # a send fails inside the Send's handler, so Stuck is posted by now
                assert pool.negotiator.receive_nowait() == Stuck(instance="encoder-1",
                                                                 message="encoder encoder-1 is not taking work")
                assert_empty(pool.negotiator)
                assert_empty(pool.tracker)  # its requests fail with its Leave
    finally:
        ctx.destroy(linger=0)


async def test_orders_from_one_delivery_leave_as_one_message_in_order(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """What the daemon orders one instance while handling one batch reaches it as one message."""
    with anyio.fail_after(5):
        async with fake_worker(ctx, tmp_path) as (address, worker), running_pool("encoder", ctx) as pool:
            await pool.join(address, work=worker)
            orders = [Work(request_id="r1", params=PARAMS), Abort(request_id="r2"),
                      Work(request_id="r3", params=PARAMS)]
            with pool.inbox.board.hold():  # as a socket pump holds the board over a batch
                for order in orders:
                    pool.inbox.post(Send(instance="encoder-1", order=order))
            key, *bodies = await worker.recv_multipart()
            assert key == KEY and [WORK_ORDER.decode(body) for body in bodies] == orders


async def test_orders_past_the_most_one_message_carries_leave_in_order_as_several(
        ctx: zmq.asyncio.Context, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker reads no more than ORDERS_PER_MESSAGE orders of one message."""
    monkeypatch.setattr("actors.pools.ORDERS_PER_MESSAGE", 2)
    with anyio.fail_after(5):
        async with fake_worker(ctx, tmp_path) as (address, worker), running_pool("encoder", ctx) as pool:
            await pool.join(address, work=worker)
            orders = [Abort(request_id=f"r{i}") for i in range(5)]
            with pool.inbox.board.hold():
                for order in orders:
                    pool.inbox.post(Send(instance="encoder-1", order=order))
            messages = [await worker.recv_multipart() for _ in range(3)]
            assert [len(bodies) for _, *bodies in messages] == [2, 2, 1]
            assert all(key == KEY for key, *_ in messages)
            assert [WORK_ORDER.decode(body) for _, *bodies in messages for body in bodies] == orders


async def test_a_batch_to_a_stuck_worker_reports_it_once(tmp_path: Path) -> None:
    ctx = zmq.Context()
    try:
        with anyio.fail_after(5):
            async with running_pool("encoder", ctx, send_hwm=1) as pool:
                await pool.join(f"ipc://{tmp_path}/nobody", capacity=3)  # its Probe fills the queue
                with pool.inbox.board.hold():
                    for order in (Work(request_id="r2", params=PARAMS), Abort(request_id="r3"),
                                  Work(request_id="r4", params=PARAMS)):
                        pool.inbox.post(Send(instance="encoder-1", order=order))
                assert isinstance(pool.negotiator.receive_nowait(), Stuck)
                assert_empty(pool.negotiator)
                pool.inbox.post(Leave(instance="encoder-1",
                                      message="encoder encoder-1 is not taking work"))
                assert (await pool.stats()).instances == []  # and its socket is closed
    finally:
        ctx.destroy(linger=0)
