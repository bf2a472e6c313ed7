"""Watching an event loop from a task of its own: whether others ran while something was read."""

from __future__ import annotations

import time

import anyio


class LoopWatch:
    """``run`` as a task: ``turns`` counts the loop's turns it got, ``longest_gap`` is the
    longest time between two (the longest anything held the loop)."""

    def __init__(self) -> None:
        self.turns = 0
        self.longest_gap = 0.0

    async def run(self) -> None:
        last = time.monotonic()
        while True:
            await anyio.sleep(0)
            now = time.monotonic()
            self.turns += 1
            self.longest_gap, last = max(self.longest_gap, now - last), now
