"""LatencyBook: the bucket counts behind Stats.latency."""

from __future__ import annotations

from actors.latency import LatencyBook
from transfer.protocol import LATENCY_BOUNDS_MS, StageTiming


def test_a_time_on_a_bound_counts_within_it_and_one_past_every_bound_in_the_last_count() -> None:
    book = LatencyBook()
    for ms in (0.0, 5.0, 5.01, 1e9):
        book.observe("request", ms)
    latency = book.latency()["request"]
    assert len(latency.counts) == len(LATENCY_BOUNDS_MS) + 1
    five = LATENCY_BOUNDS_MS.index(5)
    assert {i: c for i, c in enumerate(latency.counts) if c} == {0: 1, five: 1, five + 1: 1, len(LATENCY_BOUNDS_MS): 1}
    assert latency.total_ms == 0.0 + 5.0 + 5.01 + 1e9


def test_a_stage_counts_its_wait_its_compute_and_its_hand_off_with_the_bytes() -> None:
    book = LatencyBook()
    book.stage(StageTiming(role="denoiser", instance="denoiser-1", queued_ms=1.0, compute_ms=200.0, transfer_ms=3.0,
                           transfer_bytes=4096))
    book.stage(StageTiming(role="decoder", instance="decoder-1", queued_ms=0.0, compute_ms=40.0))
    assert {key: (sum(lat.counts), lat.total_ms) for key, lat in book.latency().items()} == {
        "denoiser.queued": (1, 1.0), "denoiser.compute": (1, 200.0), "denoiser->decoder": (1, 3.0),
        "decoder.queued": (1, 0.0), "decoder.compute": (1, 40.0),
    }
    assert book.handoff_bytes() == {"denoiser->decoder": 4096}


def test_the_bytes_of_every_hand_off_over_a_hop_add_up() -> None:
    """handoff_bytes is what crossed each hop since the daemon started, not the last request's."""
    book = LatencyBook()
    for nbytes in (4096, 1000):
        book.stage(StageTiming(role="encoder", instance="encoder-1", queued_ms=0.0, compute_ms=1.0, transfer_ms=1.0,
                               transfer_bytes=nbytes))
    assert book.handoff_bytes() == {"encoder->denoiser": 5096}
    assert sum(book.latency()["encoder->denoiser"].counts) == 2
