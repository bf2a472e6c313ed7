"""The switchboard: synchronous FIFO delivery to quiescence, bounds, holds and quiet callbacks."""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from actors.mailbox import MailboxFull, Switchboard


def test_post_delivers_at_once_in_order() -> None:
    board = Switchboard()
    box = board.mailbox("a", 8)
    seen: list[int] = []
    with box.owned_by(seen.append):
        for i in range(3):
            box.post(i)
            assert seen == list(range(i + 1))  # handled before post returns
    assert len(box) == 0


def test_mail_posted_before_the_owner_starts_waits_for_it() -> None:
    board = Switchboard()
    box = board.mailbox("a", 8)
    box.post("early")
    seen: list[str] = []
    with box.owned_by(seen.append):
        assert seen == ["early"]
    box.post("late")  # the owner stopped: it stays unread
    assert seen == ["early"] and len(box) == 1


def test_mail_queued_when_its_owner_stops_stays_unread_and_counted() -> None:
    board = Switchboard()
    a, b = board.mailbox("a", 8), board.mailbox("b", 8)
    seen: list[str] = []
    b_owner = ExitStack()
    b_owner.enter_context(b.owned_by(seen.append))

    def on_a(mail: str) -> None:
        b.post(mail)  # queued behind this handler...
        b_owner.close()  # ...which stops b's owner before it runs

    with a.owned_by(on_a):
        a.post("x")
    assert seen == [] and len(b) == 1
    with b.owned_by(seen.append):
        assert seen == ["x"] and len(b) == 0


def test_a_post_from_a_handler_queues_and_runs_after_it() -> None:
    board = Switchboard()
    a, b = board.mailbox("a", 8), board.mailbox("b", 8)
    trace: list[str] = []

    def on_a(mail: str) -> None:
        trace.append(f"a:{mail}:start")
        b.post(mail)
        a_more = mail == "1"
        if a_more:
            a.post("2")
        trace.append(f"a:{mail}:end")

    with a.owned_by(on_a), b.owned_by(lambda mail: trace.append(f"b:{mail}")):
        a.post("1")
    # Never re-entered: each handler runs to its end before the next mail is handed out,
    # and mail is handed out in the order it was posted, across mailboxes.
    assert trace == ["a:1:start", "a:1:end", "b:1", "a:2:start", "a:2:end", "b:2"]


def test_a_full_mailbox_fails_loudly_and_its_counts_keep_the_peak_and_the_handled() -> None:
    board = Switchboard()
    box = board.mailbox("small", 2)
    box.post(1)
    box.post(2)
    with pytest.raises(MailboxFull, match="small mailbox full"):
        box.post(3)
    assert box.peak == 2
    with box.owned_by(lambda mail: None):
        box.post(4)
    assert (len(box), box.peak) == (0, 2)
    assert box.counts() == (2, 3)  # the two posted before the owner, and the one after


def test_a_handler_error_reaches_the_poster_and_the_board_recovers() -> None:
    board = Switchboard()
    box = board.mailbox("a", 8)
    seen: list[int] = []

    def handle(mail: int) -> None:
        if mail == 0:
            raise ValueError("boom")
        seen.append(mail)

    with box.owned_by(handle):
        with pytest.raises(ValueError, match="boom"):
            box.post(0)
        box.post(1)
    assert seen == [1]


def test_one_owner_per_mailbox() -> None:
    box = Switchboard().mailbox("a", 8)
    with box.owned_by(lambda mail: None), pytest.raises(RuntimeError, match="already has an owner"):
        with box.owned_by(lambda mail: None):
            pass


def test_quiet_callbacks_run_after_all_mail_and_may_post_more() -> None:
    board = Switchboard()
    a, b = board.mailbox("a", 8), board.mailbox("b", 8)
    trace: list[str] = []

    def flush() -> None:
        trace.append("flush")
        b.post("from flush")

    def on_a(mail: str) -> None:
        trace.append(f"a:{mail}")
        board.when_quiet(flush)
        b.post(mail)

    with a.owned_by(on_a), b.owned_by(lambda mail: trace.append(f"b:{mail}")):
        a.post("x")
    assert trace == ["a:x", "b:x", "flush", "b:from flush"]


def test_a_hold_delivers_its_whole_batch_then_goes_quiet_once() -> None:
    board = Switchboard()
    box = board.mailbox("a", 8)
    trace: list[str] = []
    pending: list[str] = []  # what a "flush" would send, as the pools batch their orders

    def flush() -> None:
        trace.append(f"flush {pending}")
        pending.clear()

    def handle(mail: int) -> None:
        trace.append(f"mail {mail}")
        if not pending:
            board.when_quiet(flush)
        pending.append(f"order {mail}")

    with box.owned_by(handle):
        with board.hold():
            box.post(1)
            box.post(2)
            assert trace == []  # nothing delivered while held
        assert trace == ["mail 1", "mail 2", "flush ['order 1', 'order 2']"]
