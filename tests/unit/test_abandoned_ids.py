"""AbandonedIds: when a client may use again a request id it gave up on."""

from __future__ import annotations

from orchestrator.abandoned_ids import AbandonedIds


def test_an_id_given_up_on_is_held_for_its_wait_and_its_end_frees_it() -> None:
    ids = AbandonedIds()
    ids.abandon("a", 2.0, 100.0, queued=False)
    assert ids.held("a", 101.9) and not ids.held("a", 102.0) and not ids.held("b", 100.0)
    assert ids.drop("a") and not ids.drop("a")  # its end came: its answer is for nobody, once
    assert not ids.held("a", 100.0)


def test_one_queued_for_a_daemon_is_held_until_one_takes_the_connection_and_its_wait_after() -> None:
    ids = AbandonedIds()
    ids.abandon("a", 2.0, 100.0, queued=True)
    ids.abandon("b", 2.0, 100.0, queued=False)
    assert ids.held("a", 1e9)
    ids.count_holds_from(500.0)
    assert ids.held("a", 501.9) and not ids.held("a", 502.0)
    assert not ids.held("b", 102.0)  # not queued: its hold counts from when it was given up


def test_holds_run_out_are_dropped_with_their_cancel_counts_when_another_is_given_up() -> None:
    ids = AbandonedIds()
    ids.abandon("a", 1.0, 100.0, queued=False)
    ids.count_cancel("a")
    ids.abandon("b", 1.0, 101.0, queued=False)  # a's hold ran out at 101
    assert not ids.drop("a")
    assert ids.uncount_cancel("a") == 0  # its count went with it


def test_only_the_latest_cancels_answer_finding_nothing_ends_the_hold() -> None:
    """The daemon reads a connection in order: an earlier Cancel's answer may be about an
    earlier request under the id."""
    ids = AbandonedIds()
    ids.abandon("a", 10.0, 100.0, queued=False)
    ids.count_cancel("a")
    ids.count_cancel("a")
    ids.cancel_answered("a", found=False)  # the first of two
    assert ids.held("a", 101.0)
    ids.cancel_answered("a", found=True)  # the latest, which found the request: its end is still to come
    assert ids.held("a", 101.0)
    ids.count_cancel("a")
    ids.cancel_answered("a", found=False)
    assert not ids.held("a", 101.0)


def test_a_cancel_that_never_left_is_uncounted() -> None:
    ids = AbandonedIds()
    ids.count_cancel("a")
    ids.count_cancel("a")
    assert ids.uncount_cancel("a") == 1
    assert ids.uncount_cancel("a") == 0
    assert ids.uncount_cancel("a") == 0  # never below none


def test_a_replaced_socket_frees_every_id() -> None:
    ids = AbandonedIds()
    ids.abandon("a", 10.0, 100.0, queued=False)
    ids.abandon("b", 10.0, 100.0, queued=True)
    ids.count_cancel("a")
    ids.clear()
    assert not ids.held("a", 100.0) and not ids.held("b", 100.0)
    ids.abandon("a", 10.0, 100.0, queued=False)
    ids.count_cancel("a")
    ids.cancel_answered("a", found=False)  # the old socket's Cancel is no longer counted
    assert not ids.held("a", 100.0)
