"""Mailboxes, and the switchboard that delivers them: how the daemon's actors talk.

Every actor owns one bounded FIFO mailbox and a synchronous handler. No handler awaits, so
one mail is one atomic state transition. Delivery is synchronous too: a post from outside
any handler (a socket pump, a timer, a stats query) runs every handler that has mail, one
mail per turn in the order the mailboxes became ready, until every mailbox is empty; a post
from inside a handler only queues, and the delivery already running gets to it. Everything
runs on the event loop's thread, so nothing is shared between threads and nothing locks.

Sends to sockets wait for quiet too: an actor that sends registers a flush with
``when_quiet``, and it runs once every mailbox is empty. A socket pump ``hold``s the board
while it reads a batch of messages, so the batch's whole cascade of mail is handled first and
its sends leave together. Each wake of ZMQ's I/O thread costs about 90 µs of CPU on this
2-core VM against about 8 µs per message within a burst, so batching is most of the budget.

Why not a task per actor fed by an anyio memory stream: then every hop costs a task switch
and a cancellation checkpoint, about 5 µs, and a request makes about 25 hops against a
budget of 150 µs of daemon CPU. Here a hop is a deque append, a pop and a method call.

A full mailbox raises ``MailboxFull``: every mailbox is sized above the most mail the daemon
can have in flight (a few per admitted request, and admission is capped), so a full one is
a sizing bug and fails loudly instead of waiting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

M = TypeVar("M")


class MailboxFull(RuntimeError):
    """A mailbox hit its bound: the sizing invariant above was broken."""


class Switchboard:
    """Delivers the mail of every mailbox made from it, one loop thread, run to quiescence."""

    def __init__(self) -> None:
        self._ready: deque[Mailbox] = deque()
        self._quiet: list[Callable[[], None]] = []
        self._delivering = False

    def mailbox(self, name: str, bound: int) -> Mailbox:
        return Mailbox(self, name, bound)

    def when_quiet(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, when every mailbox is empty (at once if they are now)."""
        self._quiet.append(callback)
        self._deliver()

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Queue every post made in the block; deliver it all, and go quiet, at its end."""
        if self._delivering:
            yield  # already inside a delivery or a hold: that one finishes the work
            return
        self._delivering = True
        try:
            yield
        finally:
            self._delivering = False
        self._deliver()

    def _deliver(self) -> None:
        if self._delivering:
            return  # posted from a handler: the delivery running below us takes it
        self._delivering = True
        try:
            ready, quiet = self._ready, self._quiet
            while ready or quiet:
                while ready:
                    ready.popleft()._hand_one()
                while quiet and not ready:
                    quiet.pop(0)()
        finally:
            self._delivering = False


class Mailbox(Generic[M]):
    """One actor's inbox. Mail waits here only while other handlers run, or until its
    owner starts; ``peak`` is the most it ever held at once."""

    __slots__ = ("name", "peak", "_board", "_bound", "_mail", "_handler", "_scheduled")

    def __init__(self, board: Switchboard, name: str, bound: int) -> None:
        self.name = name
        self.peak = 0
        self._board = board
        self._bound = bound
        self._mail: deque[M] = deque()
        self._handler: Callable[[M], None] | None = None
        self._scheduled = False

    def __len__(self) -> int:
        return len(self._mail)

    @property
    def board(self) -> Switchboard:
        return self._board

    def post(self, mail: M) -> None:
        queued = len(self._mail)
        if queued >= self._bound:
            raise MailboxFull(f"{self.name} mailbox full ({queued}) while posting {type(mail).__name__}")
        self._mail.append(mail)
        if queued >= self.peak:
            self.peak = queued + 1
        if self._handler is not None:
            self._schedule()
            self._board._deliver()

    @contextmanager
    def owned_by(self, handler: Callable[[M], None]) -> Iterator[None]:
        """Deliver to ``handler`` while the block runs (an actor's lifetime); mail posted
        before it starts is delivered at once, mail posted after it ends waits unread."""
        if self._handler is not None:
            raise RuntimeError(f"{self.name} mailbox already has an owner")
        self._handler = handler
        try:
            if self._mail:
                self._schedule()
                self._board._deliver()
            yield
        finally:
            self._handler = None

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._board._ready.append(self)

    def _hand_one(self) -> None:
        self._scheduled = False
        if self._handler is None or not self._mail:
            return  # its owner stopped: the mail stays unread
        mail = self._mail.popleft()
        if self._mail:
            self._schedule()  # the rest waits its turn behind the other ready mailboxes
        self._handler(mail)
