"""PlainPump: a plain ZMQ socket read from the event loop, in batches, failing loudly."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import pytest
import zmq

from transfer.sockets import PUMP_BATCH, PlainPump


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://pump")
    push.connect("inproc://pump")
    yield pull, push
    ctx.destroy(linger=0)


async def test_every_message_arrives_in_order_including_those_sent_before_it_started(
    pair: tuple[zmq.Socket, zmq.Socket],
) -> None:
    pull, push = pair
    total = PUMP_BATCH * 2 + 5  # more than one batch
    seen: list[list[bytes]] = []
    batches: list[int] = []

    @contextmanager
    def hold() -> Iterator[None]:
        before = len(seen)
        yield
        batches.append(len(seen) - before)

    for i in range(3):
        push.send_multipart([b"early", str(i).encode()])
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(PlainPump(pull, seen.append, copy=True, hold=hold).run)
            for i in range(3, total):
                push.send_multipart([b"late", str(i).encode()])
            while len(seen) < total:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    assert [int(frames[1]) for frames in seen] == list(range(total))
    assert max(batches) <= PUMP_BATCH and sum(batches) == total  # each batch inside one hold


async def test_an_error_in_the_callback_ends_the_pump_with_that_error(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    pull, push = pair

    def explode(frames: list[bytes]) -> None:
        raise ValueError(f"cannot handle {frames!r}")

    push.send(b"bad")
    with anyio.fail_after(5), pytest.raises(ValueError, match="cannot handle"):
        await PlainPump(pull, explode, copy=True).run()
