"""ClientOutbox: replies on their way to clients, held in order while ZMQ has no room.

The client ROUTER queues at most ``client_send_hwm`` replies per connection (ZMQ_SNDHWM),
and ROUTER_MANDATORY makes a send past that fail (EAGAIN) instead of vanishing. A burst of
replies to one connection (hundreds of submits refused or finished at once) meets the
limit even when the client reads: ZMQ's I/O thread has not yet moved the first replies to
the kernel. So a reply ZMQ cannot take is held here, behind it every later reply to that
connection (they keep their order: progress before the final answer), and tried again
after 1 ms, then at doubling intervals up to 100 ms while that connection takes none.

What one connection has held is bounded: a reply is dropped (logged, counted) once
``client_held_bytes`` are held for its connection already, so a client that never reads
pins that much plus one reply, and a client that reads loses none, however large its
replies. So is what all of them have held: once ``client_held_total_bytes`` are held, a
reply that would wait is dropped too (at most that plus one reply is held), so connections
that never read, however many, cannot hold the daemon's memory without limit. A reply to a
connection that is gone is dropped at once, with all held for it, and its owner hears that
the connection is gone (``on_gone``): ZMQ says so only when a send finds no way to it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq

from transfer.sockets import NOBLOCK, send_frames

Reply = list[Any]  # [identity, b"", header, *frames]: bytes or zmq.Frame parts

RESEND_FIRST_S = 0.001  # a client that reads makes room within about this
RESEND_LAST_S = 0.1  # one that does not is tried this rarely


# A held reply takes more memory than its bytes: its list and the deque's slot for it, and
# an object per part (a bytes object's header, or a zmq.Frame and libzmq's message). The
# budgets count that too, or small replies (a Cancelled is 41 bytes of a 200-byte reply)
# would hold several times what they allow. Measured with tracemalloc, rounded up.
REPLY_OVERHEAD = 64
BYTES_OVERHEAD = 56
FRAME_OVERHEAD = 256


def held_cost(parts: Reply) -> int:
    """What holding ``parts`` costs the daemon's memory, in bytes."""
    return REPLY_OVERHEAD + sum(len(part) + (BYTES_OVERHEAD if type(part) is bytes else FRAME_OVERHEAD)
                                for part in parts)


@dataclass(slots=True)
class _Held:
    """One connection's replies that ZMQ had no room for, oldest first, and when to try again."""

    due: float
    replies: deque[tuple[Reply, bool]] = field(default_factory=deque)  # and whether each is awaited
    awaited: int = 0  # how many of them are
    nbytes: int = 0  # their held_cost
    delay: float = RESEND_FIRST_S


class ClientOutbox:
    def __init__(self, sock: zmq.Socket, *, held_bytes: int, held_total_bytes: int,
                 on_gone: Callable[[bytes], None], log: structlog.typing.FilteringBoundLogger) -> None:
        self._sock = sock
        self._on_gone = on_gone
        self._held_bytes = held_bytes
        self._held_total_bytes = held_total_bytes
        self._held: dict[bytes, _Held] = {}  # by connection identity
        self._total = 0  # held_cost of what is held for every connection
        self._log = log
        self.dropped = 0  # awaited replies never sent: their client was gone, or not reading

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def send(self, parts: Reply, now: float, *, awaited: bool = True) -> bool:
        """Send a reply now, or hold it if ZMQ has no room yet (never blocks). True if its
        connection starts holding replies, and so needs a resend scheduled. A reply not
        ``awaited`` (its client may have left on purpose) is not counted when it is dropped."""
        held = self._held.get(parts[0])
        if held is not None:
            self._hold(held, parts, awaited)  # behind what waits already
            return False
        try:
            send_frames(self._sock, parts, NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EAGAIN:
                self._unsendable(parts[0], 1 if awaited else 0, exc)
                return False
            self._held[parts[0]] = held = _Held(due=now + RESEND_FIRST_S)
            self._hold(held, parts, awaited)
            return True
        return False

    def resend(self, now: float) -> float | None:
        """Send what is held for each connection whose time has come, in order, as far as
        ZMQ takes it. Returns when the next connection is due (None: nothing is held)."""
        for identity, held in list(self._held.items()):
            if held.due > now:
                continue
            sent = self._send_from(identity, held)
            if not held.replies:
                del self._held[identity]
                continue
            held.delay = RESEND_FIRST_S if sent else min(2 * held.delay, RESEND_LAST_S)
            held.due = now + held.delay
        return min((held.due for held in self._held.values()), default=None)

    def abandon(self) -> None:
        """Drop everything still held (the daemon is stopping), counted and logged."""
        for held in self._held.values():
            self._drop(held.awaited, "the daemon stopped before its client took them", gone=False)
        self._held.clear()
        self._total = 0

    def _send_from(self, identity: bytes, held: _Held) -> bool:
        """Send ``held``'s replies until ZMQ has no room; True if any left. A connection that
        is gone has all of them dropped."""
        sent = False
        while held.replies:
            parts, awaited = held.replies[0]
            try:
                send_frames(self._sock, parts, NOBLOCK, copy=False)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EAGAIN:
                    count = held.awaited
                    held.replies.clear()
                    self._total -= held.nbytes
                    held.nbytes = held.awaited = 0
                    self._unsendable(identity, count, exc)
                return sent
            held.replies.popleft()
            held.awaited -= awaited
            nbytes = held_cost(parts)
            held.nbytes -= nbytes
            self._total -= nbytes
            sent = True
        return sent

    def _hold(self, held: _Held, parts: Reply, awaited: bool) -> None:
        if held.nbytes >= self._held_bytes:
            self._drop(awaited, "client_held_bytes of its replies already waiting", gone=False)
            return
        if self._total >= self._held_total_bytes:
            self._drop(awaited, "client_held_total_bytes of replies to all clients already waiting", gone=False)
            return
        nbytes = held_cost(parts)
        held.replies.append((parts, awaited))
        held.awaited += awaited
        held.nbytes += nbytes
        self._total += nbytes

    def _unsendable(self, identity: bytes, count: int, exc: zmq.ZMQError) -> None:
        gone = exc.errno == zmq.EHOSTUNREACH  # what a ROUTER_MANDATORY socket says of a closed connection
        self._drop(count, "its client's connection is closed" if gone else exc.strerror, gone=gone)
        if gone:
            self._on_gone(identity)

    def _drop(self, count: int, why: str, *, gone: bool) -> None:
        """Count and log ``count`` awaited replies dropped (none: nothing to say)."""
        if not count:
            return
        self.dropped += count
        self._log.warning("client.reply_dropped", why=why, replies=count, client_gone=gone)
