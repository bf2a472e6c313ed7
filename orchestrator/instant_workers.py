"""Workers that answer every order at once and move no data: the control-plane benchmark's peers.

They speak the real worker protocol over real sockets (register with the token, heartbeat,
answer Probe with Probed, Work/Ready with Staged or Done, Alloc with Allocated, Push with Pushed, an
Abort's ack with Stopped; a decoder's outputs on its output connection), so the
daemon cannot tell them from real workers; they skip the compute and the Mooncake write.
What remains is the daemon's own cost per request, the figure the reference head was
measured by (zero-work fake workers; docs/benchmarks.md). All of them share one
process and one poll loop, so they take as little CPU from the daemon as a peer can.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import assert_never

import msgspec
import xxhash
import zmq

from orchestrator.config import Config, transfer_timeout_s
from orchestrator.early_signals import STOP_SIGNALS
from orchestrator.work_socket import bind_work_socket, close_work_socket
from transfer.protocol import (
    DAEMON_TO_WORKER,
    PROTOCOL_VERSION,
    WORK_ORDER,
    Abort,
    Alloc,
    Allocated,
    Done,
    Heartbeat,
    Probe,
    Probed,
    Push,
    Pushed,
    Ready,
    Register,
    Registered,
    RegisterRefused,
    Role,
    SlotInfo,
    Staged,
    Stopped,
    TensorSpec,
    Work,
    WorkOrder,
    encode,
)
from transfer.reports import group_reports

# What every stage "produces": one small tensor, as the benchmark's null stages do.
OUTPUT = TensorSpec(name="out", dtype="float32", shape=(16,), offset=0, nbytes=64)
OUTPUT_FRAME = bytes(OUTPUT.nbytes)
STAGED = msgspec.structs.replace(OUTPUT, xxh3=xxhash.xxh3_64_intdigest(OUTPUT_FRAME))  # a hand-off's carries its digest
# Fake pool addresses: far apart per worker, never dereferenced by anyone.
POOL_SPACING = 1 << 32
REGISTER_TIMEOUT_S = 30.0


@dataclass
class InstantWorker:
    role: Role
    dealer: zmq.Socket
    work: zmq.Socket
    key: bytes
    pool_base: int
    outputs: zmq.Socket | None  # a decoder's output connection (its routing id: the key)

    def answer(self, order: WorkOrder) -> tuple[bytes, list[bytes]] | None:
        """The report for ``order`` with its frames, as a real worker with a zero-time stage sends it."""
        match order:
            case Work() | Ready() if self.role == "decoder":
                done = Done(request_id=order.request_id, ok=True, compute_ms=0.0, outputs=[OUTPUT])
                return encode(done), [OUTPUT_FRAME]
            case Work() | Ready():
                return encode(Staged(request_id=order.request_id, nbytes=OUTPUT.nbytes, manifest=[STAGED],
                                     compute_ms=0.0)), []
            case Alloc(request_id=rid):
                return encode(Allocated(request_id=rid, address=self.pool_base)), []
            case Push(request_id=rid):
                return encode(Pushed(request_id=rid, ok=True, transfer_ms=0.0)), []
            case Probe(instance=instance):
                return encode(Probed(instance=instance)), []
            case Abort(request_id=rid, ack=ack) if ack is not None:
                return encode(Stopped(request_id=rid, ack=ack)), []  # nothing ever runs on here
            case Abort():
                return None  # nothing is held, so there is nothing to free
            case _:
                assert_never(order)

    def take_orders(self) -> None:
        """Answer every order queued on the work socket; the reports leave as a real worker's do."""
        reports = []
        while self.work.poll(0):
            key, *orders = self.work.recv_multipart()
            if key != self.key:
                raise RuntimeError(f"an order for {self.role} without its key")
            reports.extend(filter(None, map(self.answer, map(WORK_ORDER.decode, orders))))
        for message in group_reports(report for report in reports if not report[1]):
            self.dealer.send_multipart(message)
        for body, frames in (report for report in reports if report[1]):
            assert self.outputs is not None  # only a decoder's Done has frames
            self.outputs.send_multipart([body, *frames])


def register(ctx: zmq.Context, cfg: Config, role: Role, index: int, pool_base: int, work: zmq.Socket,
             work_address: str) -> InstantWorker:
    wcfg = cfg.workers.for_role(role)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(cfg.daemon.worker_endpoint)
    slots = [] if role == "encoder" else [
        SlotInfo(slot_id=i, address=pool_base + i * wcfg.prealloc_slot_bytes, size=wcfg.prealloc_slot_bytes)
        for i in range(wcfg.prealloc_slots)
    ]
    dealer.send(encode(Register(
        protocol=PROTOCOL_VERSION, token=cfg.daemon.token, role=role, name=f"instant-{role}{index}",
        work_address=work_address, session=f"instant:{role}{index}", pool_base=pool_base,
        pool_size=wcfg.pool_bytes, slots=slots, capacity=wcfg.capacity,
        write_timeout_s=transfer_timeout_s(cfg.transfer.env.get("MC_TRANSFER_TIMEOUT")),
    )))
    if not dealer.poll(int(REGISTER_TIMEOUT_S * 1000)):
        raise TimeoutError(f"no answer from the daemon at {cfg.daemon.worker_endpoint} in {REGISTER_TIMEOUT_S}s")
    reply = DAEMON_TO_WORKER.decode(dealer.recv())
    if isinstance(reply, RegisterRefused):
        raise RuntimeError(f"registration refused: {reply.message}")
    assert isinstance(reply, Registered)
    outputs = None
    if role == "decoder":
        outputs = ctx.socket(zmq.DEALER)
        outputs.setsockopt(zmq.ROUTING_ID, reply.key)
        outputs.connect(cfg.daemon.worker_endpoint)
    return InstantWorker(role, dealer, work, reply.key, pool_base, outputs)


def serve(cfg: Config, layout: dict[Role, int]) -> None:
    """Register ``layout`` instant workers, answer orders until SIGTERM/SIGINT."""
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)
    ctx = zmq.Context()
    bound: list[tuple[zmq.Socket, str]] = []  # every work socket, closed however this ends
    workers: list[InstantWorker] = []
    try:
        for n, (role, i) in enumerate((r, i) for r, count in layout.items() for i in range(count)):
            work = ctx.socket(zmq.PULL)
            bound.append((work, bind_work_socket(work, cfg.workers.for_role(role))))
            workers.append(register(ctx, cfg, role, i, (n + 1) * POOL_SPACING, *bound[-1]))
        by_socket = {worker.work: worker for worker in workers}
        poller = zmq.Poller()
        for sock in by_socket:
            poller.register(sock, zmq.POLLIN)
        heartbeat = encode(Heartbeat())
        next_beat = 0.0
        while not stopping:
            now = time.monotonic()
            if now >= next_beat:
                for worker in workers:
                    worker.dealer.send(heartbeat)
                next_beat = now + cfg.daemon.heartbeat_s
            for sock, _ in poller.poll(timeout=100):
                by_socket[sock].take_orders()
    finally:
        for work, address in bound:
            close_work_socket(work, address)
        ctx.destroy(linger=0)
