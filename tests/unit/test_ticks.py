"""The daemon's timer: a Tick whose work outlasts the period delays the next, never stops it."""

from __future__ import annotations

import time
from typing import Any

import anyio

from orchestrator.daemon import tick


class SlowOutbox:
    """Takes each Tick's work as a mailbox delivers it, on the spot: here longer than the period."""

    def __init__(self, work_s: float) -> None:
        self.work_s = work_s
        self.ticks: list[Any] = []

    def post(self, mail: Any) -> None:
        self.ticks.append(mail)
        time.sleep(self.work_s)


async def test_ticks_go_on_when_a_ticks_work_takes_longer_than_the_period() -> None:
    """Before, the next wait came out negative and anyio's sleep raised: the daemon died
    when some 2,000 requests timed out in one tick."""
    outbox = SlowOutbox(work_s=0.03)
    with anyio.move_on_after(0.5):
        await tick(outbox, 0.01)  # type: ignore[arg-type]
    assert len(outbox.ticks) >= 5
    assert all(t.gap_s >= 0.03 for t in outbox.ticks[1:])
