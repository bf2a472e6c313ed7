"""PlainPump: a plain ZMQ socket read from the event loop, in batches, failing loudly."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import pytest
import zmq

from tests.loop_watch import LoopWatch
from transfer.sockets import NOBLOCK, PUMP_BATCH, SKIP_BATCH, PlainPump, recv_frames, send_frames


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


def test_send_frames_and_recv_frames_move_whole_messages_one_at_a_time(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    pull, push = pair
    send_frames(push, [b"key", zmq.Frame(b"order-1"), b""], copy=False)
    send_frames(push, [b"single"], NOBLOCK)
    assert pull.poll(5000)
    as_frames = recv_frames(pull, copy=False)
    assert [type(f) for f in as_frames] == [zmq.Frame] * 3
    assert [f.bytes for f in as_frames] == [b"key", b"order-1", b""]
    assert recv_frames(pull, copy=True) == [b"single"]
    with pytest.raises(zmq.Again):
        recv_frames(pull, copy=True)


async def test_a_message_of_more_frames_than_wanted_is_cut_and_its_rest_dropped_while_the_loop_runs(
    pair: tuple[zmq.Socket, zmq.Socket],
) -> None:
    """ZMQ's size limit is per frame: one message can hold millions of empty frames. Read
    whole in one callback, it held the loop (every other socket and timer) for seconds."""
    pull, push = pair
    for _ in range(SKIP_BATCH * 20):
        push.send(b"", zmq.SNDMORE)
    push.send(b"last")
    push.send_multipart([b"next", b"whole"])
    seen: list[list[bytes]] = []
    turns_before: list[int] = []  # the loop's turns before each message was handed over
    loop = LoopWatch()

    def handle(frames: list[bytes]) -> None:
        seen.append(frames)
        turns_before.append(loop.turns)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(loop.run)
            await anyio.sleep(0)
            tg.start_soon(PlainPump(pull, handle, copy=True, most_frames=3).run)
            while len(seen) < 2:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    assert seen == [[b"", b"", b""], [b"next", b"whole"]]
    assert turns_before[0] >= 10  # other tasks ran while its 20 batches were dropped
