"""Worker -> daemon reports: which of them share one worker-socket message (protocol.md §3.2).

Every report the daemon reads costs it a wake-up of its event loop and of ZMQ's I/O
thread, far more than decoding the report. So a worker sends the reports that became ready
in one turn of its loop as one message: ``[report, report, ...]``. A report with tensor
frames (the decoder's ``Done``) travels alone, its frames right after it, because the
daemon reads every frame after a ``Done`` that declares outputs as that ``Done``'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import anyio

Message = list[Any]  # frames: bytes, or buffers sent without a copy

# The most reports one message carries; the daemon reads no more of one. Reports arrive in
# one batch of the daemon's reader and may each post mail (an abort to free a late block):
# the bound keeps that within its mailboxes' room (orchestrator/daemon.py).
REPORTS_PER_MESSAGE = 256


def group_reports(queued: Iterable[tuple[bytes, Sequence[Any]]]) -> list[Message]:
    """Messages for ``(body, frames)`` reports, in order: runs of frameless ones together."""
    messages: list[Message] = []
    run: Message = []
    for body, frames in queued:
        if not frames:
            if len(run) == REPORTS_PER_MESSAGE:
                messages.append(run)
                run = []
            run.append(body)
            continue
        if run:
            messages.append(run)
            run = []
        messages.append([body, *frames])
    if run:
        messages.append(run)
    return messages


class ReportOutbox:
    """Reports queued by a worker's tasks; one sender task takes them a loop turn's worth at a time.

    ``put`` never blocks and is called on the event loop only. The sender wakes on the first
    report of a turn, so everything the other tasks queue in that same turn leaves with it.
    """

    def __init__(self) -> None:
        self._queued: list[tuple[bytes, Sequence[Any]]] = []
        self._ready = anyio.Event()

    def __len__(self) -> int:
        """Reports queued and not yet taken."""
        return len(self._queued)

    def put(self, body: bytes, frames: Sequence[Any] = ()) -> None:
        self._queued.append((body, frames))
        self._ready.set()

    async def take(self) -> list[Message]:
        """Wait for at least one report, then return every queued one as messages."""
        await self._ready.wait()
        return self.take_now()

    def take_now(self) -> list[Message]:
        """Every queued report as messages, at once (none: an empty list)."""
        self._ready = anyio.Event()
        queued, self._queued = self._queued, []
        return group_reports(queued)
