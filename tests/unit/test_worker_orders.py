"""A worker's work socket: one message carries the instance key and one or more orders."""

from __future__ import annotations

import anyio
import pytest

from orchestrator.config import Config
from orchestrator.worker import WorkerRuntime
from transfer.pool import MemoryPool
from transfer.protocol import Abort, encode

KEY = b"k" * 16


@pytest.fixture
def runtime() -> WorkerRuntime:
    """A runtime with a key and a pool holding staged blocks for r1, r2 and r3 (no sockets, no engine)."""
    worker = WorkerRuntime("encoder", Config(), name="orders-test")
    worker._key = KEY
    worker._pool = pool = MemoryPool(1 << 16)
    for rid in ("r1", "r2", "r3"):
        block = pool.try_alloc(1000)
        assert block is not None
        worker._staged[rid] = block
    return worker


async def test_every_order_of_a_message_is_handled_and_a_bad_one_skipped(runtime: WorkerRuntime) -> None:
    async with anyio.create_task_group() as tg:
        runtime._on_orders([KEY, encode(Abort(request_id="r1")), b"\xc1 not msgpack", encode(Abort(request_id="r3"))],
                           tg)
    assert set(runtime._staged) == {"r2"}  # r1 and r3 aborted: their blocks are free
    assert runtime._pool is not None and runtime._pool.allocated_blocks == 1


@pytest.mark.parametrize("parts", [[b"w" * 16, encode(Abort(request_id="r1"))], [KEY], []],
                         ids=["wrong key", "key without orders", "empty"])
async def test_a_message_without_the_key_and_an_order_does_nothing(runtime: WorkerRuntime, parts: list[bytes]) -> None:
    async with anyio.create_task_group() as tg:
        runtime._on_orders(parts, tg)
    assert set(runtime._staged) == {"r1", "r2", "r3"}
