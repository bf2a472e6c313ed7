"""A worker's registration loop: what it says while the daemon turns it away for now."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import zmq
import zmq.asyncio

from orchestrator.config import Config, EncoderWorkerConfig, ModelConfig, WorkersConfig
from orchestrator.stages import build_stage
from orchestrator.worker import WorkerRuntime
from orchestrator.worker_registration import DaemonUnreachable, WorkerRefused
from transfer.pool import MemoryPool
from transfer.protocol import WORKER_MESSAGE, Register, RegisterRefused, encode

CFG = Config(model=ModelConfig(kind="null"), workers=WorkersConfig(encoder=EncoderWorkerConfig(connect_timeout_s=0.5)))


class Engine:
    session = "127.0.0.1:1"
    write_timeout_s = 5.0


async def test_only_a_deferral_is_logged_and_named_when_the_worker_gives_up(
    tmp_path: Path, logs: list[dict]
) -> None:
    """The answers to heartbeats sent before the daemon forgot the worker also say rejoin;
    logged as deferrals they were false alarms (seen in a soak after every SIGSTOP)."""
    w = WorkerRuntime("encoder", CFG, name="w", engine=Engine())  # type: ignore[arg-type]
    w._use_pool(MemoryPool(1 << 16))
    w._runner.stage = build_stage("encoder", CFG.model, torch_threads=1)
    ctx = zmq.asyncio.Context()
    try:
        daemon, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        daemon.bind(f"ipc://{tmp_path}/d")
        dealer.connect(f"ipc://{tmp_path}/d")
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                async def answer() -> None:
                    identity, body = await daemon.recv_multipart()
                    assert isinstance(WORKER_MESSAGE.decode(body), Register)
                    for why, deferred in (("not registered (the daemon restarted or evicted this worker)", False),
                                          ("the name 'w' is held by decoder-3, a live decoder worker", True),
                                          ("the name 'w' is held by decoder-3, a live decoder worker", True)):
                        await daemon.send_multipart([identity, encode(RegisterRefused(
                            message=why, rejoin=True, deferred=deferred))])

                tg.start_soon(answer)
                with pytest.raises(WorkerRefused) as refused:
                    await w._register(dealer, "ipc://unused", patient=False)
        assert "held by decoder-3" in str(refused.value) and "connect_timeout_s" in str(refused.value)
        deferrals = [line["why"] for line in logs if line["event"] == "worker.registration_deferred"]
        assert deferrals == ["the name 'w' is held by decoder-3, a live decoder worker"]
        # The daemon answered: it is not waited for (that line sent operators looking for it).
        assert not [line for line in logs if line["event"] == "worker.waiting_for_daemon"]
    finally:
        ctx.destroy(linger=0)


async def test_a_worker_that_hears_nothing_at_a_tcp_endpoint_names_what_it_may_be(logs: list[dict]) -> None:
    """ZMQ never says a host name is unknown: the worker gave up saying only "no answer"."""
    w = WorkerRuntime("encoder", CFG, name="w", engine=Engine())  # type: ignore[arg-type]
    w._use_pool(MemoryPool(1 << 16))
    w._runner.stage = build_stage("encoder", CFG.model, torch_threads=1)
    ctx = zmq.asyncio.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect("tcp://no-such-host.invalid:5557")
        with anyio.fail_after(5), pytest.raises(DaemonUnreachable) as unreached:
            await w._register(dealer, "ipc://unused", patient=False)
        assert str(unreached.value).endswith("(nothing listens there, or its host is unreachable or unknown)")
        assert [line["event"] for line in logs].count("worker.waiting_for_daemon") == 1
    finally:
        ctx.destroy(linger=0)
