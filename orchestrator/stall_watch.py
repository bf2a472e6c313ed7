"""When this process last stood still: stopped (SIGSTOP, a frozen container) or starved,
its event loop running nothing for a while. (A VM paused by its hypervisor may not see the
pause in its monotonic clock: that pause goes unnoticed here.)

A worker that stood still may read orders the daemon sent long ago: the daemon, hearing
no heartbeats, may have evicted it and handed out again the receiver memory a ``Push``
names (after push_quarantine_s, or at once when a new process registered its name). Such
a push must not write. The event loop's own gaps say it: a task looks every half limit,
and a gap longer than the limit is a stall, noted when it ends (whichever look comes
first after it, that task's or a push's own).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio


class StallWatch:
    def __init__(self, limit_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit_s = limit_s
        self._clock = clock
        self._last_look = clock()
        self.stall_ended: float | None = None  # when the latest stall was noticed
        self.stalled_s = 0.0  # and how long it was
        self.count = 0  # stalls noticed so far

    def look(self) -> float:
        """Note that the loop runs now (and whether it stood still since the last look); now."""
        now = self._clock()
        if now - self._last_look > self.limit_s:
            self.stall_ended, self.stalled_s = now, now - self._last_look
            self.count += 1
        self._last_look = now
        return now

    def stood_still_near(self, read_at: float) -> bool:
        """Whether the loop stood still after ``read_at`` or just before it: what was read
        then may have waited out the stall unread (orders that came during a stall are read
        in the moments after it ends, within ``limit_s`` even on a busy host)."""
        self.look()
        return self.stall_ended is not None and self.stall_ended >= read_at - self.limit_s

    def stood_still_after(self, count: int) -> bool:
        """Whether a stall was noticed after the ``count``-th."""
        self.look()
        return self.count > count

    async def run(self) -> None:
        while True:
            self.look()
            await anyio.sleep(self.limit_s / 2)
