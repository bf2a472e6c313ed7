"""The stage watchdog: a worker whose stage hangs exits, so its supervisor can replace it.

A stage is synchronous code on a worker thread, and no thread can be stopped from outside:
a stop (``RunControl``) only works at the stage's next step. A run that never gets there, a
wedged GPU or a deadlocked kernel, would hold its compute thread and its capacity for good,
and the worker would keep heartbeating and taking work it cannot do. So a run longer than
``workers.<role>.stage_timeout_s`` is reported to the worker (``on_hung``), which fails
that request and ends the process with ``EXIT_STAGE_HUNG``; the daemon starts its other
requests again elsewhere.

The watchdog is a thread of its own, not a task on the worker's event loop: a shutdown
(SIGTERM) cancels every task and then waits for the stage threads, so a task would be gone
exactly when a hung stage keeps the process from exiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import structlog

from orchestrator.stages import RunControl

EXIT_STAGE_HUNG = 70  # EX_SOFTWARE
EXIT_DEVICE_BROKEN = 71  # EX_OSERR: a CUDA error left the GPU context unusable (orchestrator/stage_runner.py)


class StageWatchdog:
    """Watches every run from the moment its thread starts it until that thread returns."""

    def __init__(self, limit_s: float, *, setting: str, log: structlog.typing.FilteringBoundLogger,
                 on_hung: Callable[[str], object]) -> None:
        self.limit_s = limit_s
        self._setting = setting  # the key that sets limit_s, for the operator reading the log
        self.log = log  # the worker's; once it registers, bound to its registration (its instance)
        self._on_hung = on_hung  # called on the watchdog's thread with the run's request id; exits
        self._lock = threading.Lock()  # the runs change on the event loop, are read here
        self._runs: dict[RunControl, str] = {}

    @contextmanager
    def watching(self, control: RunControl, request_id: str) -> Iterator[None]:
        """Watch ``control``'s run for the block; its clock starts at ``control.started_at``."""
        with self._lock:
            self._runs[control] = request_id
        try:
            yield
        finally:
            with self._lock:
                del self._runs[control]

    def start(self) -> None:
        threading.Thread(target=self._watch, name="stage-watchdog", daemon=True).start()

    def check(self, now: float) -> bool:
        """Report a run that has outlived the limit at ``now``; True if one was reported."""
        with self._lock:
            runs = list(self._runs.items())
        for control, request_id in runs:
            started = control.started_at
            if started is not None and now - started > self.limit_s:
                self.log.error("worker.stage_hung", request_id=request_id, ran_s=round(now - started, 1),
                                limit_s=self.limit_s, setting=self._setting, exit_status=EXIT_STAGE_HUNG)
                self._on_hung(request_id)
                return True
        return False

    def _watch(self) -> None:
        period_s = min(1.0, self.limit_s / 4)
        while not self.check(time.monotonic()):
            time.sleep(period_s)
