"""ClientOutbox: replies on their way to clients, held in order while ZMQ has no room.

The client ROUTER queues at most ``client_send_hwm`` replies per connection (ZMQ_SNDHWM),
and ROUTER_MANDATORY makes a send past that fail (EAGAIN) instead of vanishing. A burst of
replies to one connection (hundreds of submits refused or finished at once) meets the
limit even when the client reads: ZMQ's I/O thread has not yet moved the first replies to
the kernel. So a reply ZMQ cannot take is held here, behind it every later reply to that
connection (they keep their order: progress before the final answer), and sent again as
room appears. What one connection has held is bounded, ``client_held_bytes`` but at least
one reply, so a client that never reads costs the daemon that much and no more; past it
its replies are dropped, logged and counted. A reply to a connection that is gone is
dropped at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq

from transfer.sockets import NOBLOCK, send_frames

Reply = list[Any]  # [identity, b"", header, *frames]: bytes or zmq.Frame parts


def _nbytes(parts: Reply) -> int:
    return sum(len(part) for part in parts)


@dataclass(slots=True)
class _Held:
    """One connection's replies that ZMQ had no room for, oldest first."""

    replies: deque[Reply] = field(default_factory=deque)
    nbytes: int = 0


class ClientOutbox:
    def __init__(self, sock: zmq.Socket, *, held_bytes: int, log: structlog.typing.FilteringBoundLogger) -> None:
        self._sock = sock
        self._held_bytes = held_bytes
        self._held: dict[bytes, _Held] = {}  # by connection identity
        self._log = log
        self.dropped = 0  # replies never sent: their client was gone, or not reading

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def send(self, parts: Reply) -> None:
        """Send a reply now, or hold it if ZMQ has no room yet (never blocks)."""
        held = self._held.get(parts[0])
        if held is not None:
            self._hold(held, parts)  # behind what waits already
            return
        try:
            send_frames(self._sock, parts, NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EAGAIN:
                self._drop(1, exc)
                return
            self._held[parts[0]] = held = _Held()
            self._hold(held, parts)

    def resend(self) -> bool:
        """Send what is held, each connection's in order, as far as ZMQ takes it; True if
        any reply left (or was dropped: its connection had gone)."""
        moved = False
        for identity, held in list(self._held.items()):
            while held.replies:
                parts = held.replies[0]
                try:
                    send_frames(self._sock, parts, NOBLOCK, copy=False)
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EAGAIN:
                        self._drop(len(held.replies), exc)
                        held.replies.clear()
                        moved = True
                    break
                held.replies.popleft()
                held.nbytes -= _nbytes(parts)
                moved = True
            if not held.replies:
                del self._held[identity]
        return moved

    def _hold(self, held: _Held, parts: Reply) -> None:
        size = _nbytes(parts)
        if held.replies and held.nbytes + size > self._held_bytes:
            self._drop(1, None)
            return
        held.replies.append(parts)
        held.nbytes += size

    def _drop(self, count: int, exc: zmq.ZMQError | None) -> None:
        self.dropped += count
        gone = exc is not None and exc.errno == zmq.EHOSTUNREACH
        why = "client_held_bytes of its replies already waiting" if exc is None else exc.strerror
        self._log.warning("client.reply_dropped", why=why, replies=count, client_gone=gone)
