"""The Prometheus rendering of a Stats snapshot, and of a daemon that does not answer."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import generate_latest
from prometheus_client.core import CollectorRegistry

from orchestrator.metrics import StatsCollector
from orchestrator.rejection import Rejection
from transfer.protocol import LATENCY_BOUNDS_MS, InstanceStats, Latency, Reason, Rejected, Stats


def latency(**at: int) -> Latency:
    """Counts per bucket, by the index of its bound (``b3=2``: two of at most 5 ms)."""
    counts = [0] * (len(LATENCY_BOUNDS_MS) + 1)
    for bucket, count in at.items():
        counts[int(bucket[1:])] = count
    return Latency(counts=counts, total_ms=sum(counts) * 4.0)


STATS = Stats(
    uptime_s=12.5, draining=False, queue_depths={"encoder": 0, "denoiser": 3, "decoder": 0}, handoffs_in_flight=1,
    fast_path={"encoder->denoiser": 7}, slow_path={"denoiser->decoder": 2}, requests_by_state={"denoising": 4},
    completed=40, failed_by_reason={"timed_out": 2}, late_reports=1, mailboxes={"tracker": 9},
    mail_handled={"tracker": 120}, retried=3, replies_dropped=6, refused={"overloaded": 5},
    latency={"request": latency(b3=2, b17=1), "decoder.compute": latency(b0=1), "encoder->denoiser": latency(b1=4)},
    handoff_bytes={"encoder->denoiser": 4096}, handoffs_held=2,
    instances=[InstanceStats(instance="denoiser-2", role="denoiser", name="gpu3", address="tcp://h:1", session="h:2",
                             slots_free=0, slots_total=2, slots_finishing=1, prealloc_free=0, prealloc_total=2,
                             served=17, failed=1, alive=True, suspect=True)],
)


def scrape(read_stats) -> set[str]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(read_stats))
    return {line for line in generate_latest(registry).decode().splitlines() if not line.startswith("#")}


def test_every_stats_figure_becomes_a_labelled_sample() -> None:
    lines = scrape(lambda: STATS)
    worker = 'instance="denoiser-2",name="gpu3",role="denoiser"'
    assert {
        "triptych_up 1.0",
        "triptych_uptime_seconds 12.5",
        "triptych_draining 0.0",
        "triptych_requests_completed_total 40.0",
        'triptych_requests_failed_total{reason="timed_out"} 2.0',
        "triptych_requests_retried_total 3.0",
        'triptych_requests_refused_total{reason="overloaded"} 5.0',
        'triptych_requests_in_flight{state="denoising"} 4.0',
        'triptych_queue_depth{role="denoiser"} 3.0',
        "triptych_handoffs_in_flight 1.0",
        "triptych_handoffs_held 2.0",
        'triptych_handoffs_total{hop="encoder->denoiser",path="fast"} 7.0',
        'triptych_handoffs_total{hop="denoiser->decoder",path="slow"} 2.0',
        "triptych_late_reports_total 1.0",
        "triptych_replies_dropped_total 6.0",
        'triptych_mailbox_peak{actor="tracker"} 9.0',
        'triptych_mail_handled_total{actor="tracker"} 120.0',
        f"triptych_worker_slots_free{{{worker}}} 0.0",
        f"triptych_worker_slots{{{worker}}} 2.0",
        f"triptych_worker_slots_finishing{{{worker}}} 1.0",
        f"triptych_worker_prealloc_free{{{worker}}} 0.0",
        f"triptych_worker_prealloc{{{worker}}} 2.0",
        f"triptych_worker_served_total{{{worker}}} 17.0",
        f"triptych_worker_failed_total{{{worker}}} 1.0",
        f"triptych_worker_suspect{{{worker}}} 1.0",
        # Histograms in seconds, cumulative: two requests within 5 ms, one past every bound.
        'triptych_request_duration_seconds_bucket{le="0.0025"} 0.0',
        'triptych_request_duration_seconds_bucket{le="0.005"} 2.0',
        'triptych_request_duration_seconds_bucket{le="300"} 2.0',
        'triptych_request_duration_seconds_bucket{le="+Inf"} 3.0',
        "triptych_request_duration_seconds_count 3.0",
        "triptych_request_duration_seconds_sum 0.012",
        'triptych_stage_duration_seconds_bucket{le="0.0005",part="compute",role="decoder"} 1.0',
        'triptych_handoff_duration_seconds_count{hop="encoder->denoiser"} 4.0',
        'triptych_handoff_bytes_total{hop="encoder->denoiser"} 4096.0',
    } <= lines


@pytest.mark.parametrize("failure", [TimeoutError("no reply"), ValueError("ipc://w is not a control socket"),
                                     Rejection(Rejected(request_id="", reason=Reason.OVERLOADED, message="busy"))])
def test_a_daemon_that_does_not_answer_is_down_and_nothing_else(failure: Exception) -> None:
    def no_stats() -> Stats:
        raise failure

    assert scrape(no_stats) == {"triptych_up 0.0"}  # not an HTTP 500


def test_an_idle_daemon_shows_every_state_at_zero() -> None:
    """A series that vanishes when it empties makes sums and alerts see no data."""
    idle = msgspec.structs.replace(STATS, requests_by_state={})
    assert {f'triptych_requests_in_flight{{state="{state}"}} 0.0' for state in ("encoding", "denoising", "decoding")
            } <= scrape(lambda: idle)


def test_a_fresh_daemon_shows_every_reason_and_hop_at_zero() -> None:
    """They first appeared at their first event, at 1: an alert on a counter's increase missed
    a daemon's first worker_lost (an observability audit)."""
    fresh = msgspec.structs.replace(STATS, failed_by_reason={}, refused={}, fast_path={}, slow_path={},
                                    handoff_bytes={})
    lines = scrape(lambda: fresh)
    for reason in ("worker_lost", "timed_out", "overloaded"):
        assert {f'triptych_requests_failed_total{{reason="{reason}"}} 0.0',
                f'triptych_requests_refused_total{{reason="{reason}"}} 0.0'} <= lines
    for hop in ("encoder->denoiser", "denoiser->decoder"):
        assert {f'triptych_handoffs_total{{hop="{hop}",path="fast"}} 0.0',
                f'triptych_handoffs_total{{hop="{hop}",path="slow"}} 0.0',
                f'triptych_handoff_bytes_total{{hop="{hop}"}} 0.0'} <= lines


def test_buckets_of_other_bounds_than_these_are_left_out_not_mislabelled() -> None:
    other = msgspec.structs.replace(STATS, latency={"request": Latency(counts=[1, 2], total_ms=3.0)})
    assert not any("duration_seconds" in line for line in scrape(lambda: other))
