"""Mailboxes for driving one actor: both ends closed by the test's exit stack."""

from __future__ import annotations

from contextlib import AsyncExitStack, ExitStack
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream


def open_stream(
    stack: AsyncExitStack | ExitStack, size: int = 32
) -> tuple[MemoryObjectSendStream[Any], MemoryObjectReceiveStream[Any]]:
    tx, rx = anyio.create_memory_object_stream[Any](size)
    stack.enter_context(tx)
    stack.enter_context(rx)
    return tx, rx


def queued(outbox: MemoryObjectReceiveStream[Any]) -> list[Any]:
    """Every mail waiting in ``outbox`` now, taken out."""
    out = []
    while True:
        try:
            out.append(outbox.receive_nowait())
        except anyio.WouldBlock:
            return out
