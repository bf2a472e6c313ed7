"""The whole daemon in this process, flooded: by a worker that holds the token with reports
about requests it never had (each is late and asks that worker to free a block, and all the
mail they make fits the mailboxes, however small the configured ones), by requests that
all time out in the same tick, and by registrations."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import zmq
import zmq.asyncio

from orchestrator.config import load_config
from orchestrator.control_client import Control
from orchestrator.daemon import serve
from transfer.protocol import (
    CLIENT_REPLY,
    DAEMON_TO_WORKER,
    PROTOCOL_VERSION,
    WORK_ORDER,
    Abort,
    GenParams,
    Probe,
    Reason,
    Register,
    Registered,
    Staged,
    Submit,
    encode,
)
from transfer.reports import REPORTS_PER_MESSAGE
from transfer.sockets import PUMP_BATCH

ROOT = Path(__file__).resolve().parents[2]


async def test_a_flood_of_late_reports_fits_the_mailboxes(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs" / "test.toml")
    daemon = msgspec.structs.replace(cfg.daemon, client_endpoint=f"ipc://{tmp_path}/client",
                                     control_endpoint=f"ipc://{tmp_path}/control",
                                     worker_endpoint=f"ipc://{tmp_path}/workers", max_in_flight=8, mailbox_headroom=64)
    cfg = msgspec.structs.replace(cfg, daemon=daemon)
    late = [encode(Staged(request_id=f"r{i}", nbytes=256, manifest=[], compute_ms=0.0))
            for i in range(REPORTS_PER_MESSAGE)]
    flood = PUMP_BATCH * len(late)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            endpoints = await tg.start(serve, cfg)
            with ctx.socket(zmq.PULL) as work, ctx.socket(zmq.DEALER) as worker:
                work.bind(f"ipc://{tmp_path}/work")
                worker.connect(endpoints["worker"])
                await worker.send(encode(Register(
                    protocol=PROTOCOL_VERSION, token=daemon.token, role="encoder", name="flooder",
                    work_address=f"ipc://{tmp_path}/work", session="s", pool_base=0, pool_size=0, slots=[],
                    capacity=1, write_timeout_s=5.0)))
                registered = DAEMON_TO_WORKER.decode(await worker.recv())
                assert isinstance(registered, Registered)
                assert await work.recv_multipart() == [registered.key, encode(Probe(instance=registered.instance))]
                for _ in range(PUMP_BATCH):
                    await worker.send_multipart(late)
                aborts = 0
                while aborts < flood:  # each is told to free its block, and the daemon lives
                    key, *orders = await work.recv_multipart()
                    assert key == registered.key and all(isinstance(o, Abort) for o in map(WORK_ORDER.decode, orders))
                    aborts += len(orders)
                stats = await anyio.to_thread.run_sync(Control(endpoints["control"]).stats)
                assert stats.late_reports == flood
            tg.cancel_scope.cancel()


async def test_thousands_of_requests_timing_out_in_one_tick_are_all_answered(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """No worker: every request waits for an encoder until its deadline, the same for all.
    Their expiry is one tick's work, longer than the tick: before, the daemon died of it."""
    cfg = load_config(ROOT / "configs" / "test.toml")
    daemon = msgspec.structs.replace(cfg.daemon, client_endpoint=f"ipc://{tmp_path}/client",
                                     control_endpoint=f"ipc://{tmp_path}/control",
                                     worker_endpoint=f"ipc://{tmp_path}/workers")
    cfg = msgspec.structs.replace(cfg, daemon=daemon)
    count = 3000
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            endpoints = await tg.start(serve, cfg)
            with ctx.socket(zmq.DEALER) as client:
                client.setsockopt(zmq.SNDHWM, 0)
                client.setsockopt(zmq.RCVHWM, 0)
                client.connect(endpoints["client"])
                for i in range(count):
                    await client.send_multipart([b"", encode(Submit(
                        protocol=PROTOCOL_VERSION, request_id=f"r{i}", params=GenParams(prompt="p"), timeout_s=1.0))])
                reasons: dict[str, int] = {}
                for _ in range(count):
                    _, body = await client.recv_multipart()
                    reply = CLIENT_REPLY.decode(body)
                    reasons[reply.reason] = reasons.get(reply.reason, 0) + 1
                assert reasons == {Reason.TIMED_OUT: count}
            stats = await anyio.to_thread.run_sync(Control(endpoints["control"]).stats)
            assert stats.requests_by_state == {}
            tg.cancel_scope.cancel()


async def test_registrations_past_max_workers_are_refused_and_the_daemon_serves_on(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Before, each registration took a socket of the daemon's ZMQ context (1,023 at most),
    and the one past them killed the daemon."""
    cfg = load_config(ROOT / "configs" / "test.toml")
    daemon = msgspec.structs.replace(cfg.daemon, client_endpoint=f"ipc://{tmp_path}/client",
                                     control_endpoint=f"ipc://{tmp_path}/control",
                                     worker_endpoint=f"ipc://{tmp_path}/workers")
    cfg = msgspec.structs.replace(cfg, daemon=daemon)
    answers: dict[str, int] = {}
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            endpoints = await tg.start(serve, cfg)
            for i in range(1100):
                with ctx.socket(zmq.DEALER) as worker:
                    worker.setsockopt(zmq.LINGER, 0)
                    worker.connect(endpoints["worker"])
                    await worker.send(encode(Register(
                        protocol=PROTOCOL_VERSION, token=daemon.token, role="encoder", name=f"w{i}",
                        work_address=f"ipc://{tmp_path}/nowhere{i}", session=f"s{i}", pool_base=0, pool_size=0,
                        slots=[], capacity=1, write_timeout_s=5.0)))
                    answer = type(DAEMON_TO_WORKER.decode(await worker.recv())).__name__
                    answers[answer] = answers.get(answer, 0) + 1
            stats = await anyio.to_thread.run_sync(Control(endpoints["control"]).stats)
            assert len(stats.instances) == daemon.max_workers
            tg.cancel_scope.cancel()
    assert answers == {"Registered": daemon.max_workers, "RegisterRefused": 1100 - daemon.max_workers}
