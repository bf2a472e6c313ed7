"""What every actor shares: draining an inbox in batches, and posting mail without waiting.

Handlers are synchronous, so one mail is one atomic state transition. Posting never
awaits: every mailbox is sized above the most mail the daemon can have in flight (a few
per admitted request, and admission is capped), so a full mailbox is a sizing bug and
fails loudly instead of deadlocking a cycle of actors waiting on each other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from actors.mail import QueryStats

M = TypeVar("M")

# Mails handled back to back before yielding to the event loop, so sockets and timers
# still get a turn under a burst.
BATCH = 256


class MailboxFull(RuntimeError):
    """A mailbox hit its bound: the sizing invariant above was broken."""


def post(outbox: ObjectSendStream[M], mail: M) -> None:
    try:
        outbox.send_nowait(mail)
    except anyio.WouldBlock:
        raise MailboxFull(f"mailbox full while posting {type(mail).__name__}") from None


async def drain(inbox: ObjectReceiveStream[M], handle: Callable[[M], None]) -> None:
    """Call ``handle`` on every mail until every sender has closed.

    anyio's ``receive`` yields to the loop on every call; taking what is already queued
    with ``receive_nowait`` first costs one loop turn per batch instead of per mail.
    """
    while True:
        for _ in range(BATCH):
            try:
                mail = inbox.receive_nowait()
            except anyio.WouldBlock:
                break
            except anyio.EndOfStream:
                return
            handle(mail)
        try:
            mail = await inbox.receive()
        except anyio.EndOfStream:
            return
        handle(mail)


def reply_once(reply: ObjectSendStream[M], value: M) -> None:
    """Answer a query on its one-slot reply stream and close it (the replier closes)."""
    with reply:
        reply.send_nowait(value)


def mailbox_depth(inbox: ObjectReceiveStream[M]) -> int:
    return inbox.statistics().current_buffer_used


async def drain_with_pump(
    inbox: ObjectReceiveStream[M],
    handle: Callable[[M], None],
    pump: Callable[[], Awaitable[None]],
    *,
    task_status: anyio.abc.TaskStatus[Any],
    started: Any,
) -> None:
    """An actor that also reads a socket: ``pump`` runs beside the inbox until it closes."""
    async with inbox, anyio.create_task_group() as tg:
        tg.start_soon(pump)
        task_status.started(started)
        await drain(inbox, handle)
        tg.cancel_scope.cancel()


async def ask_stats(owner: ObjectSendStream[Any]) -> Any:
    """Send ``QueryStats`` to an actor and await its answer.

    An actor's inbox is FIFO, so the answer also proves that every mail sent to it
    earlier has been handled. A query that never got delivered never reaches a replier,
    so its reply stream is closed here.
    """
    reply_tx, reply_rx = anyio.create_memory_object_stream[Any](1)
    with reply_rx:
        try:
            await owner.send(QueryStats(reply=reply_tx))
        except BaseException:
            reply_tx.close()
            raise
        return await reply_rx.receive()
