"""ClientOutbox: replies ZMQ has no room for wait, in order, per connection, within a budget."""

from __future__ import annotations

import math
import tracemalloc
from typing import Any

import pytest
import structlog
import zmq

from actors.client_outbox import RESEND_FIRST_S, RESEND_LAST_S, ClientOutbox, held_cost
from transfer.sockets import SNDMORE


class FakeRouter:
    """A ROUTER_MANDATORY socket's sends: each connection takes ``room[identity]`` more
    replies (EAGAIN after), a gone one raises EHOSTUNREACH."""

    def __init__(self) -> None:
        self.room: dict[bytes, float] = {}
        self.gone: set[bytes] = set()
        self.sent: list[list[Any]] = []
        self.heard_gone: list[bytes] = []  # what the outbox told its owner is gone
        self._message: list[Any] = []

    def send(self, part: Any, flags: int = 0, copy: bool = True) -> None:
        if not self._message:  # the identity frame: where ZMQ refuses
            if part in self.gone:
                raise zmq.ZMQError(zmq.EHOSTUNREACH)
            if self.room.get(part, math.inf) <= 0:
                raise zmq.ZMQError(zmq.EAGAIN)
        self._message.append(part)
        if not flags & SNDMORE:
            self.room[self._message[0]] = self.room.get(self._message[0], math.inf) - 1
            self.sent.append(self._message)
            self._message = []


def reply(identity: bytes, n: int, size: int = 1) -> list[Any]:
    return [identity, b"", f"reply {n}".encode(), b"x" * size]


@pytest.fixture
def sock() -> FakeRouter:
    return FakeRouter()


def outbox(sock: FakeRouter, held_bytes: int = 1 << 20, held_total_bytes: int = 1 << 30) -> ClientOutbox:
    """An outbox on ``sock`` that adds each connection it finds gone to ``sock.heard_gone``."""
    return ClientOutbox(sock, held_bytes=held_bytes, held_total_bytes=held_total_bytes,  # type: ignore[arg-type]
                        on_gone=sock.heard_gone.append, log=structlog.get_logger())


def test_replies_past_zmqs_room_wait_and_leave_in_order(sock: FakeRouter) -> None:
    box = outbox(sock)
    sock.room[b"a"] = 1
    started = [box.send(reply(b"a", n), now=0.0) for n in range(4)]
    assert started == [False, True, False, False]  # the second starts the connection's hold
    assert [m[2] for m in sock.sent] == [b"reply 0"]
    assert box.resend(now=0.0) == RESEND_FIRST_S  # not due yet: nothing tried
    sock.room[b"a"] = 2
    assert box.resend(now=RESEND_FIRST_S) == 2 * RESEND_FIRST_S  # two left; the rest tried soon
    sock.room[b"a"] = 10
    assert box.resend(now=2 * RESEND_FIRST_S) is None and not box.holding
    assert [m[2] for m in sock.sent] == [b"reply 0", b"reply 1", b"reply 2", b"reply 3"]
    assert box.dropped == 0


def test_a_connection_that_takes_nothing_is_tried_ever_more_rarely_and_alone(sock: FakeRouter) -> None:
    box = outbox(sock)
    sock.room[b"deaf"] = 0
    box.send(reply(b"deaf", 0), now=0.0)
    now, delays = RESEND_FIRST_S, []
    for _ in range(10):
        due = box.resend(now)
        assert due is not None
        delays.append(round(due - now, 6))
        now = due
    assert delays == [0.002, 0.004, 0.008, 0.016, 0.032, 0.064, RESEND_LAST_S, RESEND_LAST_S, RESEND_LAST_S,
                      RESEND_LAST_S]
    # Another connection's hold is tried on its own schedule, not the deaf one's.
    sock.room[b"b"] = 0
    assert box.send(reply(b"b", 0), now=now)
    assert box.resend(now) == now + RESEND_FIRST_S


def test_a_reply_past_the_budget_is_dropped_but_a_large_one_is_not_refused_for_a_small_one(
    sock: FakeRouter,
) -> None:
    box = outbox(sock, held_bytes=held_cost(reply(b"a", 0, size=10)) + 1)
    sock.room[b"a"] = 0
    box.send(reply(b"a", 0, size=10), now=0.0)  # a progress message, say
    box.send(reply(b"a", 1, size=1000), now=0.0)  # the result: held, past the budget
    box.send(reply(b"a", 2, size=10), now=0.0)  # the budget is spent: dropped
    assert box.dropped == 1
    sock.room[b"a"] = 10
    box.resend(now=1.0)
    assert [m[2] for m in sock.sent] == [b"reply 0", b"reply 1"]


def test_replies_held_for_a_client_that_left_are_all_dropped(sock: FakeRouter) -> None:
    box = outbox(sock)
    sock.room[b"a"] = 0
    for n in range(3):
        box.send(reply(b"a", n), now=0.0)
    sock.gone.add(b"a")
    assert box.resend(now=1.0) is None and not box.holding
    assert box.dropped == 3 and sock.sent == [] and sock.heard_gone == [b"a"]
    box.send(reply(b"a", 3), now=1.0)  # straight to a gone client: dropped at once, never held
    assert box.dropped == 4 and not box.holding and sock.heard_gone == [b"a", b"a"]


def test_a_reply_nobody_awaits_is_not_counted_when_its_client_is_gone(sock: FakeRouter) -> None:
    """The end of a request its client cancelled: that client may have closed its connection."""
    box = outbox(sock)
    sock.gone.add(b"a")
    box.send(reply(b"a", 0), now=0.0, awaited=False)
    assert box.dropped == 0 and sock.sent == [] and sock.heard_gone == [b"a"]
    box.send(reply(b"a", 1), now=0.0)
    assert box.dropped == 1


def test_a_reply_nobody_awaits_is_not_counted_when_dropped_after_waiting(sock: FakeRouter) -> None:
    """Held, or to be held, behind others for a full connection: dropped past the budget or
    with its connection found gone, it is not counted; the awaited ones around it are."""
    box = outbox(sock, held_bytes=10)
    sock.room[b"a"] = 0
    box.send(reply(b"a", 0), now=0.0)  # held
    box.send(reply(b"a", 1), now=0.0, awaited=False)  # past client_held_bytes
    assert box.dropped == 0
    box.abandon()
    assert box.dropped == 1  # a's first only
    box = outbox(sock)
    sock.room[b"b"] = 0
    box.send(reply(b"b", 0), now=0.0, awaited=False)
    box.send(reply(b"b", 1), now=0.0)
    sock.gone.add(b"b")
    box.resend(now=1.0)
    assert box.dropped == 1 and not box.holding and sock.heard_gone == [b"b"]


def test_a_connection_that_only_does_not_read_is_not_reported_gone(sock: FakeRouter) -> None:
    box = outbox(sock, held_bytes=10)
    sock.room[b"full"] = 0
    box.send(reply(b"full", 0, size=20), now=0.0)  # no room: held
    box.send(reply(b"full", 1), now=0.0)  # past client_held_bytes: dropped
    box.resend(now=1.0)
    assert box.dropped == 1 and box.holding and sock.heard_gone == []


def test_what_is_still_held_when_the_daemon_stops_is_counted(sock: FakeRouter) -> None:
    box = outbox(sock)
    sock.room[b"a"] = 0
    box.send(reply(b"a", 0), now=0.0)
    box.send(reply(b"a", 1), now=0.0)
    box.abandon()
    assert box.dropped == 2 and not box.holding


def test_what_all_connections_hold_together_is_bounded_and_freed_as_they_read_or_go(sock: FakeRouter) -> None:
    """Three connections that never read, a budget in all of two replies and a bit: the
    third's replies are dropped at once; once one connection takes its replies and another
    is gone, there is room again."""
    box = outbox(sock, held_bytes=1 << 20, held_total_bytes=2 * held_cost(reply(b"a", 0, size=40)) + 1)
    for identity in (b"a", b"b", b"c"):
        sock.room[identity] = 0
    box.send(reply(b"a", 0, size=40), now=0.0)
    box.send(reply(b"b", 0, size=40), now=0.0)
    box.send(reply(b"b", 1, size=40), now=0.0)  # three held after it: the budget is spent
    box.send(reply(b"c", 0, size=10), now=0.0)
    assert box.dropped == 1
    sock.room[b"a"] = 1
    sock.gone.add(b"b")
    box.resend(now=1.0)
    assert [m[2] for m in sock.sent] == [b"reply 0"] and box.dropped == 3  # b's two went with it
    box.send(reply(b"c", 1, size=10), now=1.0)  # nothing is held now: c's reply waits again
    box.send(reply(b"c", 2, size=40), now=1.0)  # and another: the budget is c's alone now
    assert box.holding and box.dropped == 3


@pytest.mark.parametrize("frame", [False, True])
def test_the_budget_bounds_the_memory_held_however_small_the_replies(sock: FakeRouter, frame: bool) -> None:
    """A client that never reads, sent tiny replies (a Cancelled is 41 bytes), or replies
    whose payload is a zmq.Frame (relayed outputs): what is held when its budget is reached
    is within the budget."""
    budget = 1 << 20
    box = outbox(sock, held_bytes=budget)
    sock.room[b"deaf"] = 0
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(100_000):
            parts = [b"deaf", b"", b"%036d" % n]
            box.send([*parts, zmq.Frame(b"x")] if frame else parts, now=0.0)
            if box.dropped:
                break
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert box.dropped == 1
    assert budget / 2 < held <= budget
