"""ControlActor with fake owners: a slow owner gets the operator a typed answer, not a crash."""

from __future__ import annotations

from pathlib import Path

import anyio
import zmq
import zmq.asyncio

from actors.control import ControlActor
from actors.mail import QueryStats
from actors.mailbox import Switchboard
from tests.loop_watch import LoopWatch
from transfer.protocol import CONTROL_REPLY, Drain, GetStats, Reason, Rejected, encode


async def ask_a_silent_owner(
    ctx: zmq.asyncio.Context, tmp_path: Path, requests: list[bytes]
) -> tuple[list[Rejected], anyio.Event]:
    """Send ``requests`` one by one to a ControlActor whose only owner never answers a query."""
    replies: list[Rejected] = []
    drain_requested = anyio.Event()
    with anyio.fail_after(5):
        silent = Switchboard().mailbox("frontend", 8)
        unanswered: list[QueryStats] = []
        with silent.owned_by(unanswered.append):  # takes every query, never answers one
            control = ControlActor(ctx=ctx, endpoint=f"ipc://{tmp_path}/control", owners={"frontend": silent},
                                   drain_requested=drain_requested, query_timeout_s=0.1)
            async with anyio.create_task_group() as tg:
                endpoint = await tg.start(control.run)
                client = ctx.socket(zmq.REQ)
                client.connect(endpoint)
                try:
                    for request in requests:
                        await client.send(request)
                        reply = CONTROL_REPLY.decode(await client.recv())
                        assert isinstance(reply, Rejected)
                        replies.append(reply)
                finally:
                    client.close(linger=0)
                tg.cancel_scope.cancel()
        for query in unanswered:  # the queries the silent owner never answered hold reply streams: close them
            query.reply.close()
    return replies, drain_requested


async def test_an_owner_too_slow_to_answer_gets_overloaded_and_control_keeps_serving(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    # The second query proves the actor survived the first.
    replies, drain_requested = await ask_a_silent_owner(ctx, tmp_path, [encode(GetStats())] * 2)
    for reply in replies:
        assert reply.reason == Reason.OVERLOADED and "did not answer" in reply.message
    assert not drain_requested.is_set()


async def test_a_drain_begins_even_when_an_owner_is_too_slow_to_count_the_requests(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    (reply,), drain_requested = await ask_a_silent_owner(ctx, tmp_path, [encode(Drain())])
    assert reply.reason == Reason.OVERLOADED and reply.message.endswith("the drain has begun")
    assert drain_requested.is_set()


async def test_a_message_of_many_frames_is_refused_while_the_loop_runs_on(ctx: zmq.asyncio.Context,
                                                                          tmp_path: Path) -> None:
    """ZMQ's size limit is per frame: read whole, one message of 100,000 empty frames held
    the daemon's loop (every socket and timer) for its whole read."""
    loop = LoopWatch()

    # inproc: the whole message is in the control socket's queue once it is sent, so the
    # turns counted from then are those taken while it was read.
    control = ControlActor(ctx=ctx, endpoint=f"inproc://control-{tmp_path.name}", owners={},
                           drain_requested=anyio.Event())
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            endpoint = await tg.start(control.run)
            client = ctx.socket(zmq.DEALER)
            client.connect(endpoint)
            try:
                await client.send_multipart([b"", *[b""] * 100_000, encode(GetStats())])
                before = loop.turns
                tg.start_soon(loop.run)
                empty, body = await client.recv_multipart()
            finally:
                client.close(linger=0)
            tg.cancel_scope.cancel()
    assert empty == b"" and CONTROL_REPLY.decode(body) == Rejected(
        request_id="", reason=Reason.INVALID, message="invalid control request: expected [empty, body]")
    assert loop.turns - before >= 10  # other tasks ran while its rest was dropped
