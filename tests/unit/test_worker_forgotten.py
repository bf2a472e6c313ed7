"""What a worker does once the daemon has forgotten it, before it registers again."""

from __future__ import annotations

import time

import anyio
import pytest
import structlog

from orchestrator.config import LOCAL_MOONCAKE_ENV, Config, DaemonConfig, TransferConfig
from orchestrator.worker import WorkerRuntime
from transfer.pool import MemoryPool
from transfer.protocol import Registered, RegisterRefused, Role

QUARANTINE_S = 0.3
CFG = Config(daemon=DaemonConfig(push_quarantine_s=QUARANTINE_S),
             transfer=TransferConfig(env={**LOCAL_MOONCAKE_ENV, "MC_TRANSFER_TIMEOUT": "0.1"}))


def holding(role: Role) -> WorkerRuntime:
    """A runtime (no sockets, no engine) holding two staged blocks and an allocation."""
    worker = WorkerRuntime(role, CFG, name="forgotten-test", engine=object())  # type: ignore[arg-type]
    worker._use_pool(pool := MemoryPool(1 << 16))
    assert worker._memory is not None
    for rid in ("r1", "r2"):
        worker._memory._staged[rid] = pool.try_alloc(1000)
    worker._memory._allocs["r3"] = pool.try_alloc(1000)
    return worker


@pytest.mark.parametrize(("role", "settled", "waits"), [
    ("encoder", False, False), ("denoiser", False, True), ("decoder", False, True),
    ("denoiser", True, False),  # the daemon said nothing can still be written here
])
async def test_it_frees_everything_and_only_an_unsettled_receiver_waits_out_the_quarantine(
        role: Role, settled: bool, waits: bool) -> None:
    worker = holding(role)
    stale_outbox = worker._outbox
    stale_outbox.put(b"a report about a forgotten request")
    started = time.monotonic()
    await worker._forget_everything(RegisterRefused(message="not registered", rejoin=True, settled=settled))
    waited = time.monotonic() - started
    assert worker._pool is not None and worker._pool.allocated_blocks == 0
    assert worker._memory is not None
    assert not any(worker._memory.holds_output(rid) or worker._memory.holds_input(rid) for rid in ("r1", "r2", "r3"))
    assert worker._outbox is not stale_outbox  # the unsent report is dropped with it
    assert (waited >= QUARANTINE_S) == waits


async def test_a_receiver_waits_its_daemons_quarantine_not_its_own_copys() -> None:
    """Each host's copy of the config may say its own push_quarantine_s: a receiver whose
    copy said 60 s (the default) waited that long to rejoin a daemon that holds memory 0.3 s,
    and one whose copy said less than the daemon's rejoined while writes could still land."""
    worker = WorkerRuntime("decoder", Config(), name="forgotten-test", engine=object())  # type: ignore[arg-type]
    worker._use_pool(MemoryPool(1 << 16))
    worker._adopt(Registered(instance="decoder-1", key=b"k" * 16, heartbeat_s=1.0, push_quarantine_s=QUARANTINE_S))
    started = time.monotonic()
    with anyio.fail_after(5):
        await worker._forget_everything(RegisterRefused(message="not registered", rejoin=True))
    assert QUARANTINE_S <= time.monotonic() - started < 5
    # Its lines while it waits for a daemon name no instance: that one is gone (an operator
    # audit: a rejoining worker's first line named the old daemon's).
    assert "instance" not in structlog.get_context(worker._log)
