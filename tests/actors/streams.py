"""Fake peers for driving one actor: a mailbox whose mail lands on a stream the test reads.

The actor under test posts to a real ``Mailbox`` on the test's switchboard; its owner (for
as long as the test's exit stack is open) forwards each mail at once into an anyio memory
stream, so the test takes it with ``await rx.receive()``, ``rx.receive_nowait()`` or
``queued(rx)``. The exit stack stops the forwarding and closes both ends of the stream.
"""

from __future__ import annotations

from contextlib import AsyncExitStack, ExitStack
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from actors.mailbox import Mailbox, MailboxFull, Switchboard


def open_stream(
    stack: AsyncExitStack | ExitStack, board: Switchboard, name: str = "peer", size: int = 32
) -> tuple[Mailbox[Any], MemoryObjectReceiveStream[Any]]:
    """A mailbox on ``board`` for the actor to post to, and the stream its mail comes out of."""
    tx, rx = anyio.create_memory_object_stream[Any](size)
    stack.enter_context(tx)
    stack.enter_context(rx)
    mailbox: Mailbox[Any] = board.mailbox(name, size)

    def forward(mail: Any) -> None:
        try:
            tx.send_nowait(mail)
        except anyio.WouldBlock:  # nobody took the earlier mail: as full as a real mailbox gets
            raise MailboxFull(f"{name} mailbox full ({size}) while posting {type(mail).__name__}") from None

    stack.enter_context(mailbox.owned_by(forward))
    return mailbox, rx


def queued(outbox: MemoryObjectReceiveStream[Any]) -> list[Any]:
    """Every mail waiting in ``outbox`` now, taken out."""
    out = []
    while True:
        try:
            out.append(outbox.receive_nowait())
        except anyio.WouldBlock:
            return out


def assert_empty(*outboxes: MemoryObjectReceiveStream[Any], **named: MemoryObjectReceiveStream[Any]) -> None:
    """No mail waits in any of ``outboxes`` or ``named`` now; the first found fails the test,
    named by the keyword it was passed under."""
    for name, outbox in [*((None, outbox) for outbox in outboxes), *named.items()]:
        try:
            mail = outbox.receive_nowait()
        except anyio.WouldBlock:
            continue
        raise AssertionError(f"unexpected mail{'' if name is None else f' to {name}'}: {mail!r}")
