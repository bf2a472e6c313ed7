"""Faults for the soak (orchestrator/soak.py): what breaks a local cluster the way production
breaks, at random times within a round, and what brings it back.

* ``kill``: SIGKILL a live worker (a crash, an OOM kill);
* ``term``: SIGTERM a live worker (a rolling update, a scale-down): it says Stopping, ends
  its runs, hands over its outputs, says Leaving and exits 0;
* ``stop``: SIGSTOP a live worker for 0.2-1.5 s (a long GC pause, a stalled disk) or 3.5-6 s
  (past the daemon's eviction: a frozen host), then SIGCONT;
* ``fault``: a request whose prompt makes the denoiser's device break (a CUDA error): the
  request fails and the worker exits for its supervisor to replace it;
* ``daemon``: SIGTERM the daemon (it drains), start it again; the workers rejoin.

A worker that exits is started again 0.5-2 s later, as a supervisor would.
"""

from __future__ import annotations

import random
import signal
import time
from collections import Counter
from collections.abc import Callable

import anyio
import anyio.abc

from orchestrator.cluster import LocalCluster
from orchestrator.watchdog import EXIT_DEVICE_BROKEN

WORKER_FAULTS = ("kill", "stop", "fault", "term", "fault", "kill")  # drawn from, so faults and kills twice as likely
EXPECTED_EXITS = {0, -signal.SIGKILL, EXIT_DEVICE_BROKEN}  # any other exit code is a problem


def worker_key(name: str) -> tuple[str, int]:
    """("denoiser", 1) for "denoiser1", the cluster's name for a worker."""
    role = name.rstrip("0123456789")
    return role, int(name[len(role):])


class Chaos:
    """One round's faults, between ``start`` and ``end`` (monotonic seconds), and the
    supervisor that restarts the workers they end. Which faults, and when, are drawn from
    ``rng`` alone (the traffic draws from another): a seed names a round's faults.
    ``faulty_request`` starts a request that breaks its denoiser's device; ``note`` says
    what happened; ``problem`` reports what should not have."""

    def __init__(self, cluster: LocalCluster, rng: random.Random, *, start: float, end: float,
                 restart_daemon: bool, counts: Counter[str], faulty_request: Callable[[int], None],
                 note: Callable[[str], None], problem: Callable[[str], None]) -> None:
        self._cluster = cluster
        self._rng = rng
        self._start, self._end = start, end
        self.events = rng.sample(WORKER_FAULTS, k=rng.choice([1, 2, 3]))
        self._restart_daemon = restart_daemon  # after the workers' faults, however late they end
        self.counts = counts
        self._faulty_request = faulty_request
        self._note, self._problem = note, problem
        self._down: set[str] = set()  # exited workers waiting for their restart
        self.daemon_down = (float("inf"), float("-inf"))  # when a daemon restart may explain an answer
        self.over = False  # every fault of the round done

    async def run(self) -> None:
        try:
            await anyio.sleep(max(0.0, self._start - time.monotonic()))
            span = self._end - self._start
            for event in self.events:
                if time.monotonic() > self._end:
                    break
                await self._inflict(event)
                await anyio.sleep(self._rng.uniform(0.05, 0.2) * span)
            if self._restart_daemon:
                await self._inflict("daemon")
        finally:
            self.over = True

    async def _inflict(self, event: str) -> None:
        self.counts[event] += 1
        if event == "fault":
            self._faulty_request(self.counts[event])
            return
        if event == "daemon":
            self._note("daemon restart")
            # Answers up to a second before it (the SIGTERM's drain) and a few after (the
            # clients reconnecting) may be ones a restart explains.
            began = time.monotonic() - 1
            self.daemon_down = (began, float("inf"))
            code = await anyio.to_thread.run_sync(self._cluster.stop_daemon)
            if code != 0:
                self._problem(f"the daemon exited {code} on SIGTERM")
            await anyio.sleep(self._rng.uniform(0.2, 2))
            self._cluster.start_daemon()
            self.daemon_down = (began, time.monotonic() + 4)
            return
        live = [(name, proc) for name, proc in self._cluster.workers.items()
                if proc.poll() is None and name not in self._down]
        if not live:
            self.counts[event] -= 1
            return
        name, proc = self._rng.choice(live)
        if event in ("kill", "term"):
            signum = signal.SIGKILL if event == "kill" else signal.SIGTERM
            self._note(f"{signum.name} {name}")
            proc.send_signal(signum)
            return
        pause_s = self._rng.choice([self._rng.uniform(0.2, 1.5), self._rng.uniform(3.5, 6)])
        self._note(f"SIGSTOP {name} for {pause_s:.1f}s")
        proc.send_signal(signal.SIGSTOP)
        try:
            await anyio.sleep(pause_s)
        finally:
            proc.send_signal(signal.SIGCONT)

    async def supervise(self, tg: anyio.abc.TaskGroup) -> None:
        """Restart every worker that exits, 0.5-2 s later; until cancelled."""
        while True:
            for name, proc in list(self._cluster.workers.items()):
                code = proc.poll()
                if code is None or name in self._down:
                    continue
                if code not in EXPECTED_EXITS:
                    self._problem(f"{name} exited {code}")
                self._down.add(name)
                tg.start_soon(self._restart, name)
            await anyio.sleep(0.3)

    async def _restart(self, name: str) -> None:
        await anyio.sleep(self._rng.uniform(0.5, 2.0))
        self._cluster.start_worker(*worker_key(name))
        self.counts["worker restarts"] += 1
        self._down.discard(name)

    def overlaps_daemon_restart(self, began: float, ended: float) -> bool:
        down_from, down_until = self.daemon_down
        return began <= down_until and ended >= down_from
