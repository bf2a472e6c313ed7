"""ClientConnections: the client ROUTER's monitor, and which waiting connection each close ends.

A ROUTER says nothing when a connection closes (ROUTER_NOTIFY, which would, is a draft
option this libzmq lacks), so a request whose client died would run to its end for nobody.
The socket's monitor does say so, naming the connection's file descriptor only; a message
carries the descriptor it came by (ZMQ_SRCFD). So the frontend files each connection that
waits for a request under its descriptor, and a close of that descriptor names the
connections to give up on.

The kernel hands a closed descriptor's number to the next connection. libzmq queues the
DISCONNECTED event before it closes the descriptor, so an earlier connection's close is
already in the monitor's queue when a message from a later one on the same number is read:
``watch`` reads that queue first, and never files a new connection under an old one's close.
A message read after its own connection's close (still queued in the ROUTER) is filed under
a descriptor that is closed or another's: the next close there gives it up, which is right,
or its reply finds no way there (the client outbox says so too).
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable
from types import TracebackType

import zmq

from transfer.sockets import EVENTS, POLLIN, recv_frames

# A monitor event's first frame: the event (uint16) and its value (uint32), here the descriptor.
_EVENT = struct.Struct("=HI")
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
_addresses = itertools.count()


class ClientConnections:
    """Owns the monitor of the client ROUTER and, per watched connection, its descriptor."""

    def __init__(self, ctx: zmq.Context, router: zmq.Socket, on_closed: Callable[[bytes], None]) -> None:
        address = f"inproc://client-connections-{next(_addresses)}"
        # A plain socket (for a PlainPump) even under an asyncio context. No high-water mark:
        # libzmq's I/O thread blocks on a full monitor, and every socket of the daemon with it.
        self.monitor = zmq.Socket(ctx, zmq.PAIR)
        try:
            self.monitor.setsockopt(zmq.LINGER, 0)
            self.monitor.setsockopt(zmq.RCVHWM, 0)
            self.monitor.connect(address)  # before the monitor exists: no event waits for a reader
            router.monitor(address, zmq.EVENT_DISCONNECTED)
        except BaseException:
            self.monitor.close()
            raise
        self._router = router
        self._on_closed = on_closed  # a watched connection closed (its identity)
        self._by_fd: dict[int, set[bytes]] = {}
        self._fd_of: dict[bytes, int] = {}

    def __enter__(self) -> ClientConnections:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._router.disable_monitor()
        self.monitor.close()

    def watch(self, identity: bytes, fd: int) -> None:
        """File ``identity``'s connection under ``fd``, the descriptor its message came by."""
        if fd < 0:
            return  # a transport without one: its close is learned when a reply finds no way
        self.read()  # every close already queued: one of them may be an earlier holder of ``fd``
        self._fd_of[identity] = fd
        self._by_fd.setdefault(fd, set()).add(identity)

    def unwatch(self, identity: bytes) -> None:
        """``identity`` waits for nothing any more (or was given up on)."""
        fd = self._fd_of.pop(identity, None)
        if fd is not None:
            holders = self._by_fd[fd]
            holders.discard(identity)
            if not holders:
                del self._by_fd[fd]

    def read(self) -> None:
        """Take in every event queued (the monitor's reader does this as they come)."""
        while self.monitor.getsockopt(EVENTS) & POLLIN:
            self.heard(recv_frames(self.monitor, copy=True))

    def heard(self, frames: list[bytes]) -> None:
        """One monitor event: a close gives up on every connection filed under its descriptor."""
        event, fd = _EVENT.unpack_from(frames[0])
        if event != _DISCONNECTED:
            return
        for identity in self._by_fd.pop(fd, ()):
            del self._fd_of[identity]
            self._on_closed(identity)
