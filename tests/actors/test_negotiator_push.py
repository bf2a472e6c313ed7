"""TransferNegotiator driven like the daemon drives it: fake peers, and fake workers.

Each fake worker is a DEALER on the negotiator's ``ipc://`` worker endpoint (in tmp_path)
that registers with the configured token and then reports as a real worker would. Mail in
(``Placed``, ``Forget``) goes through the inbox; what the negotiator orders comes out on the
fake pools' streams as ``Send`` mail, never on a work socket.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.mail import (
    Enqueue,
    Failed,
    Forget,
    HandedOff,
    Job,
    Join,
    LimitsChanged,
    NegotiatorMail,
    Placed,
    QueryStats,
    Release,
    Send,
)
from actors.negotiator import NegotiatorStats, PreallocCounts, TransferNegotiator
from orchestrator.config import DaemonConfig
from transfer.protocol import (
    DAEMON_TO_WORKER,
    PROTOCOL_VERSION,
    ROLES,
    Abort,
    Alloc,
    Allocated,
    GenParams,
    Push,
    Pushed,
    Ready,
    Reason,
    Register,
    Registered,
    RegisterRefused,
    Role,
    SlotInfo,
    Staged,
    TensorSpec,
    Work,
    WorkerMessage,
    encode,
)

PARAMS = GenParams(prompt="p")
TOKEN = "negotiator-test-token"
NBYTES = 512
MANIFEST = [TensorSpec(name="embeds", dtype="float32", shape=(128,), offset=0, nbytes=NBYTES)]
POOL_BASE = 1 << 20
SLOT_SIZE = 1024
HOP = "encoder->denoiser"


@pytest.fixture
def ctx() -> Iterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


def job(rid: str, role: Role) -> Job:
    return Job(request_id=rid, role=role, params=PARAMS)


@dataclass
class Negotiator:
    inbox: MemoryObjectSendStream[NegotiatorMail]
    endpoint: str
    pools: dict[Role, MemoryObjectReceiveStream[Any]]
    admission: MemoryObjectReceiveStream[Any]
    tracker: MemoryObjectReceiveStream[Any]
    frontend: MemoryObjectReceiveStream[Any]

    async def stats(self) -> NegotiatorStats:
        """Ask for stats; the answer also proves every earlier mail was handled."""
        reply_tx, reply_rx = anyio.create_memory_object_stream[Any](1)
        with reply_rx:
            await self.inbox.send(QueryStats(reply=reply_tx))
            return await reply_rx.receive()

    def assert_silent(self) -> None:
        for name, outbox in (("admission", self.admission), ("tracker", self.tracker),
                             ("frontend", self.frontend), *self.pools.items()):
            try:
                mail = outbox.receive_nowait()
            except anyio.WouldBlock:
                continue
            raise AssertionError(f"unexpected mail to {name}: {mail!r}")


@dataclass
class FakeWorker:
    sock: zmq.asyncio.Socket
    instance: str
    session: str

    async def report(self, msg: WorkerMessage) -> None:
        await self.sock.send(encode(msg))


@asynccontextmanager
async def running_negotiator(ctx: zmq.asyncio.Context, tmp_path: Path) -> AsyncIterator[Negotiator]:
    cfg = DaemonConfig(worker_endpoint=f"ipc://{tmp_path}/workers", token=TOKEN)
    async with AsyncExitStack() as stack:

        def stream() -> tuple[MemoryObjectSendStream[Any], MemoryObjectReceiveStream[Any]]:
            tx, rx = anyio.create_memory_object_stream[Any](32)
            stack.enter_context(tx)
            stack.enter_context(rx)
            return tx, rx

        inbox_tx, inbox_rx = stream()
        (ad_tx, ad_rx), (tr_tx, tr_rx), (fe_tx, fe_rx) = stream(), stream(), stream()
        pools = {role: stream() for role in ROLES}
        actor = TransferNegotiator(inbox_rx, ctx=ctx, cfg=cfg, pools={r: tx for r, (tx, _) in pools.items()},
                                   admission=ad_tx, tracker=tr_tx, frontend=fe_tx)
        async with anyio.create_task_group() as tg:
            endpoint = await tg.start(actor.run)
            yield Negotiator(inbox_tx, endpoint, {r: rx for r, (_, rx) in pools.items()}, ad_rx, tr_rx, fe_rx)
            inbox_tx.close()  # the inbox ends; run returns and closes the worker socket


@asynccontextmanager
async def fake_worker(ctx: zmq.asyncio.Context, n: Negotiator, role: Role, *,
                      slots: int = 0) -> AsyncIterator[FakeWorker]:
    """Register a ``role`` worker whose memory pool carries ``slots`` preallocated slots."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(n.endpoint)
    try:
        session = f"{role}-session"
        await sock.send(encode(Register(
            protocol=PROTOCOL_VERSION, token=TOKEN, role=role, name=f"{role}-worker", work_address="ipc://unused",
            session=session, pool_base=POOL_BASE, pool_size=1 << 20,
            slots=[SlotInfo(slot_id=i, address=POOL_BASE + i * SLOT_SIZE, size=SLOT_SIZE) for i in range(slots)],
            capacity=2,
        )))
        registered = DAEMON_TO_WORKER.decode(await sock.recv())
        assert isinstance(registered, Registered), registered
        # Posted before the reply went out, so both are there already.
        join = n.pools[role].receive_nowait()
        assert isinstance(join, Join) and join.instance == registered.instance and join.session == session
        assert isinstance(n.frontend.receive_nowait(), LimitsChanged)
        yield FakeWorker(sock, registered.instance, session)
    finally:
        sock.close(linger=0)


async def stage_encoder_output(n: Negotiator, encoder: FakeWorker, rid: str) -> None:
    """The encoder pool placed ``rid``; the negotiator ordered the work; the encoder staged its output."""
    await n.inbox.send(Placed(job=job(rid, "encoder"), instance=encoder.instance))
    assert await n.pools["encoder"].receive() == Send(instance=encoder.instance,
                                                      order=Work(request_id=rid, params=PARAMS), starts=True)
    await encoder.report(Staged(request_id=rid, nbytes=NBYTES, manifest=MANIFEST, compute_ms=1.0))
    assert await n.admission.receive() == Enqueue(job=job(rid, "denoiser"))


async def push_on_fast_path(n: Negotiator, encoder: FakeWorker, denoiser: FakeWorker, rid: str) -> None:
    """The denoiser pool placed ``rid``: a free slot fits, so the encoder is told to push at once."""
    await stage_encoder_output(n, encoder, rid)
    await n.inbox.send(Placed(job=job(rid, "denoiser"), instance=denoiser.instance))
    assert await n.pools["encoder"].receive() == Send(instance=encoder.instance, order=Push(
        request_id=rid, session=denoiser.session, address=POOL_BASE, nbytes=NBYTES))  # best fit: slot 0
    stats = await n.stats()
    assert stats.prealloc[denoiser.instance] == PreallocCounts(1, 2, True)
    assert (stats.handoffs_in_flight, stats.fast_path, stats.slow_path) == (1, {HOP: 1}, {})


# --------------------------------------------------------------------------- failed push


async def test_failed_push_frees_the_receivers_slot_and_fails_the_request(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with (
            running_negotiator(ctx, tmp_path) as n,
            fake_worker(ctx, n, "encoder") as encoder,
            fake_worker(ctx, n, "denoiser", slots=2) as denoiser,
        ):
            assert (await n.stats()).prealloc[denoiser.instance] == PreallocCounts(2, 2, True)
            await push_on_fast_path(n, encoder, denoiser, "r1")

            await encoder.report(Pushed(request_id="r1", ok=False, transfer_ms=0.0, error="link down"))
            assert await n.pools["encoder"].receive() == Release(request_id="r1", instance=encoder.instance, ok=False)
            assert await n.tracker.receive() == Failed(
                request_id="r1", reason=Reason.TRANSFER_FAILED,
                message=f"{encoder.instance} -> {denoiser.instance}: link down")
            stats = await n.stats()
            assert stats.prealloc[denoiser.instance] == PreallocCounts(2, 2, True)  # back at once
            assert stats.handoffs_in_flight == 0
            n.assert_silent()  # a preallocated slot needs no abort; no Ready goes out

            # The tracker's Forget comes back through admission and the pools: nothing left to
            # free (recycling the slot twice would raise inside the actor).
            await n.inbox.send(Forget(request_id="r1"))
            stats = await n.stats()
            assert stats.prealloc[denoiser.instance] == PreallocCounts(2, 2, True)
            n.assert_silent()


async def test_slot_freed_by_a_failed_push_serves_the_next_hand_off(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with (
            running_negotiator(ctx, tmp_path) as n,
            fake_worker(ctx, n, "encoder") as encoder,
            fake_worker(ctx, n, "denoiser", slots=1) as denoiser,
        ):
            await stage_encoder_output(n, encoder, "r1")
            await n.inbox.send(Placed(job=job("r1", "denoiser"), instance=denoiser.instance))
            assert isinstance((await n.pools["encoder"].receive()).order, Push)
            await encoder.report(Pushed(request_id="r1", ok=False, transfer_ms=0.0, error="link down"))
            await n.pools["encoder"].receive()  # Release
            await n.tracker.receive()  # Failed
            await stage_encoder_output(n, encoder, "r2")
            await n.inbox.send(Placed(job=job("r2", "denoiser"), instance=denoiser.instance))
            send = await n.pools["encoder"].receive()
            assert send.order == Push(request_id="r2", session=denoiser.session, address=POOL_BASE, nbytes=NBYTES)
            assert (await n.stats()).fast_path == {HOP: 2}


async def test_failed_push_into_an_allocation_aborts_it_at_the_receiver(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Slow path: the receiver allocated for the push; once the push fails it is told to free it."""
    with anyio.fail_after(5):
        async with (
            running_negotiator(ctx, tmp_path) as n,
            fake_worker(ctx, n, "encoder") as encoder,
            fake_worker(ctx, n, "denoiser", slots=0) as denoiser,
        ):
            await stage_encoder_output(n, encoder, "r1")
            await n.inbox.send(Placed(job=job("r1", "denoiser"), instance=denoiser.instance))
            assert await n.pools["denoiser"].receive() == Send(instance=denoiser.instance,
                                                               order=Alloc(request_id="r1", nbytes=NBYTES))
            address = POOL_BASE + 8192
            await denoiser.report(Allocated(request_id="r1", address=address))
            assert await n.pools["encoder"].receive() == Send(instance=encoder.instance, order=Push(
                request_id="r1", session=denoiser.session, address=address, nbytes=NBYTES))

            await encoder.report(Pushed(request_id="r1", ok=False, transfer_ms=0.0, error="link down"))
            assert await n.pools["encoder"].receive() == Release(request_id="r1", instance=encoder.instance, ok=False)
            assert await n.pools["denoiser"].receive() == Send(instance=denoiser.instance,
                                                               order=Abort(request_id="r1"))
            failed = await n.tracker.receive()
            assert (failed.request_id, failed.reason) == ("r1", Reason.TRANSFER_FAILED)
            stats = await n.stats()
            assert (stats.handoffs_in_flight, stats.slow_path) == (0, {HOP: 1})
            n.assert_silent()
            await n.inbox.send(Forget(request_id="r1"))  # no second Abort: the flight is gone
            await n.stats()
            n.assert_silent()


async def test_report_after_a_failed_push_is_late(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with (
            running_negotiator(ctx, tmp_path) as n,
            fake_worker(ctx, n, "encoder") as encoder,
            fake_worker(ctx, n, "denoiser", slots=2) as denoiser,
        ):
            await push_on_fast_path(n, encoder, denoiser, "r1")
            await encoder.report(Pushed(request_id="r1", ok=False, transfer_ms=0.0, error="link down"))
            await n.tracker.receive()
            await encoder.report(Pushed(request_id="r1", ok=True, transfer_ms=1.0))
            while (stats := await n.stats()).late_reports == 0:  # arrives on the socket, not the inbox
                await anyio.sleep(0.005)
            assert stats.late_reports == 1
            assert stats.prealloc[denoiser.instance] == PreallocCounts(2, 2, True)
            await n.pools["encoder"].receive()  # the first report's Release
            n.assert_silent()


# --------------------------------------------------------------------------- for contrast


async def test_successful_push_keeps_the_slot_as_the_receivers_input(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with (
            running_negotiator(ctx, tmp_path) as n,
            fake_worker(ctx, n, "encoder") as encoder,
            fake_worker(ctx, n, "denoiser", slots=2) as denoiser,
        ):
            await push_on_fast_path(n, encoder, denoiser, "r1")
            await encoder.report(Pushed(request_id="r1", ok=True, transfer_ms=1.0))
            assert await n.pools["encoder"].receive() == Release(request_id="r1", instance=encoder.instance, ok=True)
            handed = await n.tracker.receive()
            assert isinstance(handed, HandedOff) and (handed.request_id, handed.fast_path) == ("r1", True)
            assert await n.pools["denoiser"].receive() == Send(instance=denoiser.instance, starts=True, order=Ready(
                request_id="r1", params=PARAMS, address=POOL_BASE, manifest=MANIFEST, slot_id=0))
            stats = await n.stats()
            assert stats.prealloc[denoiser.instance] == PreallocCounts(1, 2, True)
            assert stats.handoffs_in_flight == 0
            # Forgotten while the denoiser runs: its input slot goes back.
            await n.inbox.send(Forget(request_id="r1"))
            assert (await n.stats()).prealloc[denoiser.instance] == PreallocCounts(2, 2, True)


async def test_forget_mid_push_keeps_the_slot_until_the_push_reports(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with (
            running_negotiator(ctx, tmp_path) as n,
            fake_worker(ctx, n, "encoder") as encoder,
            fake_worker(ctx, n, "denoiser", slots=2) as denoiser,
        ):
            await push_on_fast_path(n, encoder, denoiser, "r1")
            await n.inbox.send(Forget(request_id="r1"))
            assert (await n.stats()).prealloc[denoiser.instance] == PreallocCounts(1, 2, True)
            await encoder.report(Pushed(request_id="r1", ok=True, transfer_ms=1.0))
            while (stats := await n.stats()).prealloc[denoiser.instance].free == 1:
                await anyio.sleep(0.005)
            assert stats.prealloc[denoiser.instance] == PreallocCounts(2, 2, True)
            assert stats.handoffs_in_flight == 0
            n.assert_silent()  # the pools freed their own holds on Forget; the tracker already knows


async def test_registration_with_a_wrong_token_is_refused(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """The fake workers above register for real: the token they carry is the one checked."""
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path) as n:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(n.endpoint)
                await sock.send(encode(Register(
                    protocol=PROTOCOL_VERSION, token="wrong", role="denoiser", name="w", work_address="ipc://unused",
                    session="s", pool_base=0, pool_size=0, slots=[], capacity=1)))
                reply = DAEMON_TO_WORKER.decode(await sock.recv())
                assert reply == RegisterRefused(message="bad token")
            finally:
                sock.close(linger=0)
            assert (await n.stats()).prealloc == {}
            n.assert_silent()
