"""What every actor shares: owning a mailbox for its lifetime, answering a stats query,
and asking one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
from anyio.abc import ObjectSendStream

from actors.mail import QueryStats
from actors.mailbox import Mailbox

M = TypeVar("M")


async def serve_mailbox(
    inbox: Mailbox[M],
    handle: Callable[[M], None],
    *,
    pump: Callable[[], Awaitable[None]] | None = None,
    task_status: anyio.abc.TaskStatus[Any],
    started: Any = None,
) -> None:
    """An actor's life: ``handle`` gets its mail until cancelled. An actor that also reads
    a socket passes its ``pump``, which runs for as long."""
    with inbox.owned_by(handle):
        task_status.started(started)
        if pump is None:
            await anyio.sleep_forever()
        else:
            await pump()


def reply_once(reply: ObjectSendStream[M], value: M) -> None:
    """Answer a query on its one-slot reply stream and close it (the replier closes)."""
    with reply:
        reply.send_nowait(value)


async def ask_stats(owner: Mailbox[Any]) -> Any:
    """Post ``QueryStats`` to an actor and await its answer.

    An actor's mailbox is FIFO, so the answer also proves that every mail posted to it
    earlier has been handled. A query that is never delivered (its owner stopped) leaves
    this waiting: callers put a deadline around it.
    """
    reply_tx, reply_rx = anyio.create_memory_object_stream[Any](1)
    with reply_rx:
        try:
            owner.post(QueryStats(reply=reply_tx))
        except BaseException:
            reply_tx.close()
            raise
        return await reply_rx.receive()
