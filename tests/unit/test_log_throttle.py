"""Throttled: warnings a peer can provoke at will stay a few lines, and say what they left out."""

from __future__ import annotations

import pytest
import structlog

from orchestrator import log as log_module
from orchestrator.log import Throttled


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(log_module.time, "monotonic", lambda: now[0])
    return now


def test_a_flood_logs_a_burst_per_window_and_the_next_window_counts_the_rest(
    clock: list[float], logs: list[dict]
) -> None:
    throttled = Throttled(structlog.get_logger(), burst=3, window_s=10.0)
    for i in range(50):
        throttled.warning("worker.bad_message", n=i)
    assert [line["n"] for line in logs] == [0, 1, 2]
    clock[0] += 10.0
    throttled.warning("worker.bad_message", n=50)
    assert logs[-1] == {"event": "worker.bad_message", "log_level": "warning", "n": 50, "left_out": 47}
    throttled.warning("worker.bad_message", n=51)
    assert "left_out" not in logs[-1]


def test_each_event_has_its_own_budget(clock: list[float], logs: list[dict]) -> None:
    throttled = Throttled(structlog.get_logger(), burst=1)
    for _ in range(5):
        throttled.warning("worker.bad_message")
        throttled.warning("worker.refused")
    assert [line["event"] for line in logs] == ["worker.bad_message", "worker.refused"]
