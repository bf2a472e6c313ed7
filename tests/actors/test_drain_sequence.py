"""The daemon's drain sequence against fake actors: every wait in it ends, loudly."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import anyio

from actors.base import reply_once
from actors.mail import QueryStats, SetDraining, StartDrain
from actors.mailbox import Switchboard
from orchestrator import daemon
from orchestrator.daemon import END_ALL_FLUSH_S


async def test_a_farewell_nobody_confirms_still_ends_the_drain_and_says_so(logs: list[dict]) -> None:
    """The negotiator never takes its mail (here: it has no owner): the daemon still stops."""
    board = Switchboard()
    frontend, tracker, negotiator = (board.mailbox(name, 8) for name in ("frontend", "tracker", "negotiator"))

    def front(mail: Any) -> None:
        if isinstance(mail, QueryStats):
            reply_once(mail.reply, None)
        else:
            assert isinstance(mail, SetDraining)

    def track(mail: Any) -> None:
        assert isinstance(mail, StartDrain)
        mail.drained.set()  # nothing in flight

    requested = anyio.Event()
    requested.set()
    with ExitStack() as owners, anyio.fail_after(END_ALL_FLUSH_S + 5):
        owners.enter_context(frontend.owned_by(front))
        owners.enter_context(tracker.owned_by(track))
        async with anyio.create_task_group() as tg:
            tg.start_soon(daemon._drain_on_request, tg.cancel_scope, requested, anyio.CancelScope(), frontend,
                          tracker, negotiator, 5.0)
            await anyio.sleep_forever()  # until the drain cancels the daemon's task group
    assert [line["event"] for line in logs][-2:] == ["daemon.drained", "daemon.farewell_unconfirmed"]
    with negotiator.owned_by(lambda mail: mail.reply.close() if isinstance(mail, QueryStats) else None):
        pass  # the unread query's reply stream, closed
