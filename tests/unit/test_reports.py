"""Which worker reports share one worker-socket message (transfer/reports.py)."""

from __future__ import annotations

import anyio

from transfer.reports import REPORTS_PER_MESSAGE, ReportOutbox, group_reports


def test_frameless_reports_share_a_message_and_one_with_frames_travels_alone_in_order() -> None:
    queued = [(b"a", ()), (b"b", ()), (b"done", [b"f0", b"f1"]), (b"c", ()), (b"done2", [b"g"]), (b"d", ())]
    assert group_reports(queued) == [[b"a", b"b"], [b"done", b"f0", b"f1"], [b"c"], [b"done2", b"g"], [b"d"]]


def test_nothing_queued_makes_no_message() -> None:
    assert group_reports([]) == []


async def test_reports_put_in_one_loop_turn_leave_together_and_later_ones_wait_for_the_next_take() -> None:
    outbox = ReportOutbox()
    taken: list[list[list[bytes]]] = []

    async def sender() -> None:
        while True:
            taken.append(await outbox.take())

    async with anyio.create_task_group() as tg:
        tg.start_soon(sender)
        await anyio.sleep(0)  # the sender now waits
        for body in (b"staged-1", b"pushed-2", b"allocated-3"):
            outbox.put(body)
        outbox.put(b"done-4", [b"frame"])
        await anyio.wait_all_tasks_blocked()
        outbox.put(b"staged-5")
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert taken == [[[b"staged-1", b"pushed-2", b"allocated-3"], [b"done-4", b"frame"]], [[b"staged-5"]]]


def test_a_long_run_of_reports_is_cut_at_the_daemon_s_limit() -> None:
    queued = [(bytes([i % 256]), ()) for i in range(2 * REPORTS_PER_MESSAGE + 1)]
    messages = group_reports(queued)
    assert [len(m) for m in messages] == [REPORTS_PER_MESSAGE, REPORTS_PER_MESSAGE, 1]
    assert [body for m in messages for body in m] == [body for body, _ in queued]
