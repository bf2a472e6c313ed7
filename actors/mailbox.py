"""Mailboxes, and the switchboard that delivers them: how the daemon's actors talk.

Every actor owns one bounded FIFO mailbox and a synchronous handler. No handler awaits, so
one mail is one atomic state transition. Delivery is synchronous too: a post from outside
any handler (a socket pump, a timer, a stats query) hands out mail in the order it was
posted, one mail at a time, until every mailbox is empty; a post from inside a handler only
queues, and the delivery already running gets to it. Everything
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
from typing import Generic, NamedTuple, TypeVar

M = TypeVar("M")


class MailboxFull(RuntimeError):
    """A mailbox hit its bound: the sizing invariant above was broken."""


class MailboxCounts(NamedTuple):
    """What an actor reports about its mailbox in its stats answer."""

    peak: int  # the most mail it held at once
    handled: int  # mail its owner has handled: the daemon's internal hops, counted


class Switchboard:
    """Delivers the mail of every mailbox made from it, one loop thread, run to quiescence.

    All its mailboxes share one FIFO of ``(mailbox, mail)``, so mail is handled in the order
    it was posted, which keeps every mailbox FIFO too. A hop is then one append and one pop:
    per mailbox queues and a ready list cost three more calls a hop, and a request makes
    about 25 hops.
    """

    def __init__(self) -> None:
        self._queue: deque[tuple[Mailbox, object]] = deque()
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
            queue, quiet = self._queue, self._quiet
            while queue or quiet:
                while queue:
                    box, mail = queue.popleft()
                    handler = box._handler
                    if handler is None:
                        box._unread.append(mail)  # its owner stopped: the mail stays unread
                        continue
                    box._queued -= 1
                    box.handled += 1
                    handler(mail)
                while quiet and not queue:
                    quiet.pop(0)()
        finally:
            self._delivering = False


class Mailbox(Generic[M]):
    """One actor's inbox. Mail waits only while other handlers run, or until its owner
    starts; ``peak`` is the most it ever held at once, ``handled`` how much its owner took."""

    __slots__ = ("name", "peak", "handled", "_board", "_bound", "_queued", "_unread", "_handler")

    def __init__(self, board: Switchboard, name: str, bound: int) -> None:
        self.name = name
        self.peak = 0
        self.handled = 0
        self._board = board
        self._bound = bound
        self._queued = 0  # on the board's queue or unread here
        self._unread: deque[M] = deque()  # posted while nobody owned the mailbox
        self._handler: Callable[[M], None] | None = None

    def __len__(self) -> int:
        return self._queued

    @property
    def board(self) -> Switchboard:
        return self._board

    def counts(self) -> MailboxCounts:
        return MailboxCounts(self.peak, self.handled)

    def post(self, mail: M) -> None:
        queued = self._queued
        if queued >= self._bound:
            raise MailboxFull(f"{self.name} mailbox full ({queued}) while posting {type(mail).__name__}")
        self._queued = queued + 1
        if queued >= self.peak:
            self.peak = queued + 1
        if self._handler is None:
            self._unread.append(mail)
            return
        board = self._board
        board._queue.append((self, mail))
        if not board._delivering:
            board._deliver()

    @contextmanager
    def owned_by(self, handler: Callable[[M], None]) -> Iterator[None]:
        """Deliver to ``handler`` while the block runs (an actor's lifetime); mail posted
        before it starts is delivered at once, mail posted after it ends waits unread."""
        if self._handler is not None:
            raise RuntimeError(f"{self.name} mailbox already has an owner")
        self._handler = handler
        try:
            if self._unread:
                board = self._board
                board._queue.extend((self, mail) for mail in self._unread)
                self._unread.clear()
                board._deliver()
            yield
        finally:
            self._handler = None
