"""ControlActor with fake owners: a slow owner gets the operator a typed answer, not a crash."""

from __future__ import annotations

from pathlib import Path

import anyio
import zmq
import zmq.asyncio

from actors.control import ControlActor
from actors.mail import QueryStats
from actors.mailbox import Switchboard
from transfer.protocol import CONTROL_REPLY, GetStats, Reason, Rejected, encode


async def test_an_owner_too_slow_to_answer_gets_overloaded_and_control_keeps_serving(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        silent = Switchboard().mailbox("frontend", 8)
        unanswered: list[QueryStats] = []
        with silent.owned_by(unanswered.append):  # takes every query, never answers one
            control = ControlActor(ctx=ctx, endpoint=f"ipc://{tmp_path}/control", owners={"frontend": silent},
                                   drain_requested=anyio.Event(), query_timeout_s=0.1)
            async with anyio.create_task_group() as tg:
                endpoint = await tg.start(control.run)
                client = ctx.socket(zmq.REQ)
                client.connect(endpoint)
                try:
                    for _ in range(2):  # the second proves the actor survived the first
                        await client.send(encode(GetStats()))
                        reply = CONTROL_REPLY.decode(await client.recv())
                        assert isinstance(reply, Rejected) and reply.reason == Reason.OVERLOADED
                        assert "did not answer" in reply.message
                finally:
                    client.close(linger=0)
                tg.cancel_scope.cancel()
        for query in unanswered:  # the queries the silent owner never answered hold reply streams: close them
            query.reply.close()
