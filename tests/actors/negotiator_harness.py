"""The negotiator test harness: TransferNegotiator driven like the daemon drives it.

Each fake worker is a DEALER on the negotiator's ``ipc://`` worker endpoint (in tmp_path)
that registers with the configured token and then reports as a real worker would. Mail in
(``Placed``, ``Forget``) is posted to its mailbox; what the negotiator orders comes out on
the fake pools' streams as ``Send`` mail, never on a work socket.
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

from actors.base import ask_stats
from actors.mail import Enqueue, Job, Join, LimitsChanged, NegotiatorMail, Placed, Release, Send, Suspect
from actors.mailbox import Mailbox, Switchboard
from actors.negotiator import NegotiatorStats, PreallocCounts, TransferNegotiator
from orchestrator.config import DaemonConfig
from tests.actors.streams import assert_empty, open_stream, queued
from transfer.protocol import (
    DAEMON_TO_WORKER,
    PROTOCOL_VERSION,
    ROLES,
    Abort,
    Alloc,
    Allocated,
    Done,
    GenParams,
    LocalMemory,
    Probed,
    Push,
    Pushed,
    Ready,
    Register,
    Registered,
    Role,
    SlotInfo,
    Staged,
    Step,
    TensorSpec,
    Work,
    WorkerMessage,
    encode,
)

PARAMS = GenParams(prompt="p")
TOKEN = "negotiator-test-token"
NBYTES = 512
MANIFEST = [TensorSpec(name="embeds", dtype="float32", shape=(128,), offset=0, nbytes=NBYTES, xxh3=1)]
POOL_BASE = 1 << 20
POOL_SIZE = 1 << 20
SLOT_SIZE = 1024
HOP = "encoder->denoiser"


# Far off, and the same in every job: each Enqueue compared with ``job`` checks that the
# next stage's job carries its request's deadline.
DEADLINE = 1e9


def job(rid: str, role: Role, priority: int = 0) -> Job:
    """``rid``'s job at ``role``; past the encoder, its input is the NBYTES staged before it."""
    return Job(request_id=rid, role=role, params=PARAMS, deadline=DEADLINE, priority=priority,
               nbytes=0 if role == "encoder" else NBYTES)


@dataclass
class Negotiator:
    inbox: Mailbox[NegotiatorMail]
    endpoint: str
    pools: dict[Role, MemoryObjectReceiveStream[Any]]
    admission: MemoryObjectReceiveStream[Any]
    tracker: MemoryObjectReceiveStream[Any]
    frontend: MemoryObjectReceiveStream[Any]

    async def stats(self) -> NegotiatorStats:
        """Ask for stats; the answer also proves every earlier mail was handled."""
        return await ask_stats(self.inbox)

    def take(self, name: str) -> list[Any]:
        """Every mail posted so far to ``name`` (a role, "admission", "tracker" or "frontend")."""
        outbox = {"admission": self.admission, "tracker": self.tracker, "frontend": self.frontend,
                  **self.pools}[name]
        return queued(outbox)

    def assert_withdrawn(self, role: Role, instance: str) -> None:
        """The frontend was told ``instance`` left: its limits no longer bind the door."""
        assert self.frontend.receive_nowait() == LimitsChanged(role=role, instance=instance, limits=None)

    def assert_silent(self) -> None:
        assert_empty(admission=self.admission, tracker=self.tracker, frontend=self.frontend, **self.pools)


@dataclass
class FakeWorker:
    sock: zmq.asyncio.Socket
    instance: str
    session: str
    key: bytes = b""  # Registered.key: its orders' prefix, and its output connection's routing id

    async def report(self, msg: WorkerMessage) -> None:
        await self.sock.send(encode(msg))


@asynccontextmanager
async def running_negotiator(ctx: zmq.asyncio.Context, tmp_path: Path, **settings: Any) -> AsyncIterator[Negotiator]:
    cfg = DaemonConfig(worker_endpoint=f"ipc://{tmp_path}/workers", token=TOKEN, **settings)
    async with AsyncExitStack() as stack:

        board = Switchboard()
        stream = partial(open_stream, stack, board)
        inbox = board.mailbox("negotiator", 32)
        (ad_box, ad_rx), (tr_box, tr_rx), (fe_box, fe_rx) = stream("admission"), stream("tracker"), stream("frontend")
        pools = {role: stream(f"pool.{role}") for role in ROLES}
        actor = TransferNegotiator(inbox, ctx=ctx, cfg=cfg,
                                   pools={r: box for r, (box, _) in pools.items()},
                                   admission=ad_box, tracker=tr_box, frontend=fe_box)
        async with anyio.create_task_group() as tg:
            endpoint = await tg.start(actor.run)
            yield Negotiator(inbox, endpoint, {r: rx for r, (_, rx) in pools.items()}, ad_rx, tr_rx, fe_rx)
            tg.cancel_scope.cancel()  # run is cancelled and closes the worker socket


def shared_pool(host: str, role: Role) -> LocalMemory:
    """A fake worker's pool as shared memory on ``host``."""
    return LocalMemory(host=host, path=f"/proc/1/fd/{ROLES.index(role)}", device=1, inode=ROLES.index(role),
                       base=POOL_BASE, size=POOL_SIZE)


# The fake workers' Mooncake write timeout: below the shortest push_quarantine_s a test sets,
# which the daemon refuses a worker's for (a push is still due the write's own grace and
# PUSH_REPORT_GRACE_S on: transfer.engine.write_limit_s).
WRITE_TIMEOUT_S = 0.01


def registration(role: Role, session: str, slots: int | list[int], local: LocalMemory | None = None,
                 token: str = TOKEN, work_address: str = "ipc://unused", pool_size: int = POOL_SIZE,
                 write_timeout_s: float = WRITE_TIMEOUT_S, name: str = "") -> Register:
    """``role``'s Register, with ``slots`` preallocated slots of SLOT_SIZE bytes (or of these
    sizes), carved from the pool's start."""
    sizes = [SLOT_SIZE] * slots if isinstance(slots, int) else slots
    return Register(
        protocol=PROTOCOL_VERSION, token=token, role=role, name=name or f"{role}-worker", work_address=work_address,
        session=session, pool_base=POOL_BASE, pool_size=pool_size,
        slots=[SlotInfo(slot_id=i, address=POOL_BASE + sum(sizes[:i]), size=size) for i, size in enumerate(sizes)],
        capacity=2, write_timeout_s=write_timeout_s, local=local,
    )


async def register(sock: zmq.asyncio.Socket, role: Role, session: str, slots: int | list[int],
                   local: LocalMemory | None = None, pool_size: int = POOL_SIZE,
                   write_timeout_s: float = WRITE_TIMEOUT_S, name: str = "") -> Registered:
    """Send ``role``'s Register on ``sock`` and await the Registered."""
    await sock.send(encode(registration(role, session, slots, local, pool_size=pool_size,
                                        write_timeout_s=write_timeout_s, name=name)))
    registered = DAEMON_TO_WORKER.decode(await sock.recv())
    assert isinstance(registered, Registered), registered
    return registered


@asynccontextmanager
async def fake_worker(ctx: zmq.asyncio.Context, n: Negotiator, role: Role, *,
                      slots: int | list[int] = 0, host: str | None = None,
                      pool_size: int = POOL_SIZE, write_timeout_s: float = WRITE_TIMEOUT_S,
                      name: str = "") -> AsyncIterator[FakeWorker]:
    """Register a ``role`` worker whose memory pool of ``pool_size`` bytes carries ``slots``
    preallocated slots (and, with ``host``, is shared memory on that host), and whose
    writes time out after ``write_timeout_s``; a second of a role needs a ``name`` of its own."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(n.endpoint)
    try:
        session = f"{name or role}-session"
        registered = await register(sock, role, session, slots, shared_pool(host, role) if host else None,
                                    pool_size, write_timeout_s, name)
        # Posted before the reply went out, so both are there already.
        join = n.pools[role].receive_nowait()
        assert isinstance(join, Join) and join.instance == registered.instance and join.session == session
        assert isinstance(n.frontend.receive_nowait(), LimitsChanged)
        # Its pool sends a Probe now; the fake answers as a worker does, and is offered work.
        await sock.send(encode(Probed(instance=registered.instance)))
        assert await n.pools[role].receive() == Suspect(instance=registered.instance, suspect=False)
        yield FakeWorker(sock, registered.instance, session, registered.key)
    finally:
        sock.close(linger=0)


async def wait_late(n: Negotiator, count: int) -> NegotiatorStats:
    """Wait until ``count`` late reports were counted (reports arrive on the socket, not the inbox)."""
    while (stats := await n.stats()).late_reports < count:
        await anyio.sleep(0.005)
    return stats


async def speak(n: Negotiator, worker: FakeWorker) -> None:
    """A sign of life from ``worker``, read by the negotiator when this returns (a report about
    no request: it counts as late, and the count says it was handled)."""
    late = (await n.stats()).late_reports
    await worker.report(Step(request_id="nobody", step=0, steps=1))
    await wait_late(n, late + 1)


async def stage_encoder_output(n: Negotiator, encoder: FakeWorker, rid: str, priority: int = 0) -> None:
    """The encoder pool placed ``rid``; the negotiator ordered the work (with the request's
    priority); the encoder staged its output, and the denoiser job went to admission with it."""
    n.inbox.post(Placed(job=job(rid, "encoder", priority), instance=encoder.instance))
    assert await n.pools["encoder"].receive() == Send(instance=encoder.instance,
                                                      order=Work(request_id=rid, params=PARAMS, priority=priority))
    await encoder.report(Staged(request_id=rid, nbytes=NBYTES, manifest=MANIFEST, compute_ms=1.0))
    assert await n.admission.receive() == Enqueue(job=job(rid, "denoiser", priority))


async def push_on_fast_path(n: Negotiator, encoder: FakeWorker, denoiser: FakeWorker, rid: str) -> None:
    """The denoiser pool placed ``rid``: a free slot fits, so the encoder is told to push at once."""
    await stage_encoder_output(n, encoder, rid)
    n.inbox.post(Placed(job=job(rid, "denoiser"), instance=denoiser.instance))
    assert await n.pools["encoder"].receive() == Send(instance=encoder.instance, order=Push(
        request_id=rid, session=denoiser.session, address=POOL_BASE, nbytes=NBYTES))  # best fit: slot 0
    stats = await n.stats()
    assert stats.prealloc[denoiser.instance] == PreallocCounts(1, 2)
    # Counted once its Pushed(ok) comes, not before: a push may yet fail.
    assert (stats.handoffs_in_flight, stats.fast_path, stats.slow_path) == (1, {}, {})


async def ask_to_allocate(n: Negotiator, encoder: FakeWorker, denoiser: FakeWorker, rid: str) -> None:
    """The encoder staged ``rid``'s output and the denoiser pool placed it; no preallocated slot
    fits: the denoiser is asked to allocate."""
    await stage_encoder_output(n, encoder, rid)
    n.inbox.post(Placed(job=job(rid, "denoiser"), instance=denoiser.instance))
    assert await n.pools["denoiser"].receive() == Send(instance=denoiser.instance,
                                                       order=Alloc(request_id=rid, nbytes=NBYTES))


async def allocate_on_slow_path(n: Negotiator, encoder: FakeWorker, denoiser: FakeWorker, rid: str,
                                address: int) -> None:
    """The denoiser is asked to allocate (``ask_to_allocate``), answers, and the encoder is told to push."""
    await ask_to_allocate(n, encoder, denoiser, rid)
    await denoiser.report(Allocated(request_id=rid, address=address))
    assert await n.pools["encoder"].receive() == Send(instance=encoder.instance, order=Push(
        request_id=rid, session=denoiser.session, address=address, nbytes=NBYTES))


@asynccontextmanager
async def encoder_and_denoiser(ctx: zmq.asyncio.Context, tmp_path: Path, *, slots: int | list[int],
                               pool_size: int = POOL_SIZE, write_timeout_s: float = WRITE_TIMEOUT_S,
                               **settings: Any) -> AsyncIterator[tuple[Negotiator, FakeWorker, FakeWorker]]:
    """A running negotiator with a registered encoder (its writes timing out after
    ``write_timeout_s``) and a denoiser carrying ``slots`` slots in a pool of ``pool_size`` bytes."""
    async with (
        running_negotiator(ctx, tmp_path, **settings) as n,
        fake_worker(ctx, n, "encoder", write_timeout_s=write_timeout_s) as encoder,
        fake_worker(ctx, n, "denoiser", slots=slots, pool_size=pool_size) as denoiser,
    ):
        yield n, encoder, denoiser


async def next_order(n: Negotiator, role: Role, kind: type) -> None:
    """Skip ``role``'s pool mail up to the next order of ``kind``."""
    while not isinstance(mail := await n.pools[role].receive(), Send) or not isinstance(mail.order, kind):
        pass


@asynccontextmanager
async def decoding(ctx: zmq.asyncio.Context, tmp_path: Path, rid: str) -> AsyncIterator[tuple[Negotiator, FakeWorker]]:
    """A negotiator whose decoder is running ``rid``, its latents received; the mail so far taken."""
    async with (
        encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, encoder, denoiser),
        fake_worker(ctx, n, "decoder", slots=1) as decoder,
    ):
        await push_on_fast_path(n, encoder, denoiser, rid)
        await encoder.report(Pushed(request_id=rid, ok=True, transfer_ms=1.0))
        await next_order(n, "denoiser", Ready)
        await denoiser.report(Staged(request_id=rid, nbytes=NBYTES, manifest=MANIFEST, compute_ms=1.0))
        assert await n.admission.receive() == Enqueue(job=job(rid, "decoder"))
        n.inbox.post(Placed(job=job(rid, "decoder"), instance=decoder.instance))
        await denoiser.report(Pushed(request_id=rid, ok=True, transfer_ms=1.0))
        await next_order(n, "decoder", Ready)
        n.take("encoder"), n.take("denoiser"), n.take("tracker"), n.take("decoder")
        yield n, decoder


IMAGE = TensorSpec(name="image", dtype="uint8", shape=(2, 2, 3), nbytes=12)


def output(rid: str) -> list[bytes]:
    """A decoder's result for ``rid``: its Done, then IMAGE's frame."""
    return [encode(Done(request_id=rid, ok=True, compute_ms=1.0, outputs=[IMAGE])), bytes(range(12))]


@asynccontextmanager
async def connection(ctx: zmq.asyncio.Context, n: Negotiator, routing_id: bytes) -> AsyncIterator[zmq.asyncio.Socket]:
    """A DEALER on the worker socket under ``routing_id``: a decoder's output connection
    when that is its key."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.connect(n.endpoint)
    try:
        yield sock
    finally:
        sock.close(linger=0)


def released(rid: str, worker: FakeWorker, ok: bool | None = None, *, finishing: bool = False) -> Release:
    return Release(request_id=rid, instance=worker.instance, ok=ok, finishing=finishing)


def aborted(rid: str, worker: FakeWorker, ack: int | None = None) -> Send:
    return Send(instance=worker.instance, order=Abort(request_id=rid, ack=ack))


def stopped_while_running(rid: str, worker: FakeWorker, ack: int) -> list[Any]:
    """What ending ``rid`` while its stage runs at ``worker`` posts to that worker's pool: the
    slot held until the run ends, and an Abort whose ``ack`` the worker answers then."""
    return [released(rid, worker, finishing=True), aborted(rid, worker, ack)]
