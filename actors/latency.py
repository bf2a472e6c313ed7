"""LatencyBook: how long requests, stages and hand-offs take, as bucket counts.

The tracker writes it down as each stage's timing comes in (each observation a bisection
over a few bounds), and ``Stats`` carries it to ``triptych stats`` and to Prometheus
histograms: the evidence of where a request's time goes, worker to worker.
"""

from __future__ import annotations

import bisect

from transfer.protocol import LATENCY_BOUNDS_MS, ROLES, Latency, Role, StageTiming, hop_name, next_role


def _stage_keys(role: Role) -> tuple[str, str, str | None]:
    following = next_role(role)
    return f"{role}.queued", f"{role}.compute", hop_name(role, following) if following is not None else None


# Made once: the tracker records every stage of every request.
STAGE_KEYS: dict[Role, tuple[str, str, str | None]] = {role: _stage_keys(role) for role in ROLES}


class LatencyBook:
    def __init__(self) -> None:
        self._counts: dict[str, list[int]] = {}
        self._totals: dict[str, float] = {}
        self._bytes: dict[str, int] = {}

    def observe(self, key: str, ms: float) -> None:
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = [0] * (len(LATENCY_BOUNDS_MS) + 1)
            self._totals[key] = 0.0
        counts[bisect.bisect_left(LATENCY_BOUNDS_MS, ms)] += 1
        self._totals[key] += ms

    def stage(self, timing: StageTiming) -> None:
        """One stage of one request, its hand-off to the next stage included."""
        queued, compute, hop = STAGE_KEYS[timing.role]
        self.observe(queued, timing.queued_ms)
        self.observe(compute, timing.compute_ms)
        if hop is not None:
            self.observe(hop, timing.transfer_ms)
            self._bytes[hop] = self._bytes.get(hop, 0) + timing.transfer_bytes

    def latency(self) -> dict[str, Latency]:
        return {key: Latency(counts=list(counts), total_ms=self._totals[key]) for key, counts in self._counts.items()}

    def handoff_bytes(self) -> dict[str, int]:
        return dict(self._bytes)
