"""The soak's judgement: which answers each kind of request may get, the bytes check, and
what in the cluster's logs is a problem."""

from __future__ import annotations

import argparse
import types
from pathlib import Path

import pytest

from orchestrator.chaos import worker_key
from orchestrator.client_wire import Generation
from orchestrator.config import NullStageConfig
from orchestrator.soak import Ledger, LogWatch, Round, verdict
from orchestrator.stages.null import expected_outputs
from transfer.frames import to_frames
from transfer.protocol import GenParams, Result

NULL = NullStageConfig(encoder_ms=0, denoiser_ms=0, decoder_ms=0, embed_shape=(1, 4, 8))


@pytest.mark.parametrize(("kind", "outcome"), [
    ("plain", "ok"), ("plain", "worker_lost"), ("short", "timed_out"), ("cancel", "cancelled"),
    ("fail", "stage_failed"), ("blocking_short", "timed_out"),
])
def test_what_a_request_of_its_kind_may_end_in_passes(kind: str, outcome: str) -> None:
    assert verdict(kind, outcome, elapsed_s=1.0, timeout_s=30.0, around_restart=False) is None


@pytest.mark.parametrize(("kind", "outcome"), [
    ("plain", "timed_out"), ("plain", "stage_failed"), ("plain", "TimeoutError"), ("fail", "ok"),
    ("cancel", "timed_out"), ("plain", "KeyError"),
])
def test_what_nothing_explains_is_a_problem(kind: str, outcome: str) -> None:
    assert outcome in verdict(kind, outcome, elapsed_s=1.0, timeout_s=30.0, around_restart=False)


def test_a_drain_or_a_lost_connection_is_explained_only_around_a_daemon_restart() -> None:
    for outcome in ("draining", "ConnectionError"):
        assert verdict("plain", outcome, elapsed_s=1.0, timeout_s=30.0, around_restart=True) is None
        assert verdict("plain", outcome, elapsed_s=1.0, timeout_s=30.0, around_restart=False) is not None


def test_an_answer_long_past_its_deadline_is_a_problem_whatever_it_says() -> None:
    assert "after 3.50s" in verdict("short", "timed_out", elapsed_s=3.5, timeout_s=0.2, around_restart=False)
    assert verdict("short", "timed_out", elapsed_s=3.1, timeout_s=0.2, around_restart=False) is None


def test_a_device_fault_must_fail_as_one() -> None:
    said = "the device failed: CUDA error"
    assert verdict("fault", "stage_failed", elapsed_s=1, timeout_s=30, around_restart=False, message=said) is None
    assert verdict("fault", "stage_failed", elapsed_s=1, timeout_s=30, around_restart=False,
                   message="told to fail") is not None


def test_the_bytes_check_flags_a_result_that_is_not_its_requests() -> None:
    ledger = Ledger()
    cluster = types.SimpleNamespace(config=types.SimpleNamespace(model=types.SimpleNamespace(null=NULL)))
    args = argparse.Namespace(seed=1, round_s=10.0)
    soak_round = Round(cluster, 0, args, restart_daemon=False, ledger=ledger)  # type: ignore[arg-type]
    params = GenParams(prompt="a cat", width=16, height=16, seed=3, output="raw")

    def generation(of: GenParams, request_id: str = "r") -> Generation:
        specs, frames = to_frames(expected_outputs(of, NULL))
        return Generation(Result(request_id=request_id, outputs=specs, stages=[], total_ms=1.0),
                          [bytearray(frame) for frame in frames])

    soak_round._check("r", params, generation(params))
    assert ledger.problems == []
    soak_round._check("r", params, generation(GenParams(prompt="a dog", width=16, height=16, seed=3, output="raw")))
    soak_round._check("r", params, generation(params, request_id="other"))
    assert len(ledger.problems) == 2
    assert "wrong bytes" in ledger.problems[0] and "the Result of other" in ledger.problems[1]


def test_a_worker_key_is_its_role_and_index() -> None:
    assert worker_key("denoiser12") == ("denoiser", 12)


def test_a_crash_or_a_digest_mismatch_in_any_log_is_a_problem_once(tmp_path: Path) -> None:
    """No sender is frozen past the quarantine in a soak: a worker whose input is not what
    was staged shows a hand-off bug, even when the request it failed was retried and the
    client never saw it."""
    ledger, watch = Ledger(), LogWatch(tmp_path)
    (tmp_path / "decoder0.log").write_text('{"event":"worker.registered"}\n')
    watch.scan(ledger)
    assert ledger.problems == []
    with (tmp_path / "decoder0.log").open("a") as log:
        log.write('{"event":"worker.input_corrupted","request_id":"r1"}\n')
    (tmp_path / "daemon.log").write_text('{"event":"process.crashed"}\n')
    watch.scan(ledger)
    watch.scan(ledger)  # each line once
    assert [problem.split(":")[0] for problem in ledger.problems] == ["daemon.log", "decoder0.log"]
