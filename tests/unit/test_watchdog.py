"""The stage watchdog's rule, with the worker's exit (``on_hung``) replaced by a recorder."""

from __future__ import annotations

import time

import structlog
from structlog.testing import capture_logs

from orchestrator.stages import RunControl
from orchestrator.watchdog import EXIT_STAGE_HUNG, StageWatchdog


def watchdog(hung: list[str], limit_s: float = 10.0) -> StageWatchdog:
    return StageWatchdog(limit_s, setting="workers.encoder.stage_timeout_s", log=structlog.get_logger(),
                         on_hung=hung.append)


def test_a_run_past_the_limit_is_reported_once_with_its_request() -> None:
    hung: list[str] = []
    dog = watchdog(hung)
    control = RunControl()
    with dog.watching(control, "r1"), capture_logs() as logs:
        control.started_at = 100.0
        assert not dog.check(109.9)
        assert dog.check(110.1)
    assert hung == ["r1"]
    assert logs == [{"event": "worker.stage_hung", "log_level": "error", "request_id": "r1", "ran_s": 10.1,
                     "limit_s": 10.0, "setting": "workers.encoder.stage_timeout_s",
                     "exit_status": EXIT_STAGE_HUNG}]


def test_a_stopped_run_is_still_watched_until_its_thread_returns() -> None:
    """A stop only works at the stage's next step: a run deaf to it is still hung."""
    hung: list[str] = []
    dog = watchdog(hung)
    control = RunControl()
    with dog.watching(control, "r1"):
        control.started_at = 0.0
        control.stop()
        assert dog.check(11.0)
    assert hung == ["r1"]


def test_time_waiting_for_a_compute_thread_and_finished_runs_do_not_count() -> None:
    hung: list[str] = []
    dog = watchdog(hung)
    waiting, finished = RunControl(), RunControl()
    with dog.watching(waiting, "queued"):  # its thread has not started it: no clock yet
        with dog.watching(finished, "done"):
            finished.started_at = 0.0
        assert not dog.check(1e9)
    assert hung == []


def test_the_watchdog_thread_reports_on_its_own() -> None:
    hung: list[str] = []
    dog = watchdog(hung, limit_s=0.04)
    control = RunControl()
    with dog.watching(control, "r1"):
        control.started_at = time.monotonic()
        dog.start()
        deadline = time.monotonic() + 5
        while not hung and time.monotonic() < deadline:
            time.sleep(0.01)
    assert hung == ["r1"]
