"""ClientConnections: the client ROUTER's monitor, and which waiting connection each close ends.

A ROUTER says nothing when a connection closes (ROUTER_NOTIFY, which would, is a draft
option this libzmq lacks), so a request whose client died would run to its end for nobody.
The socket's monitor does say so, naming the connection's file descriptor only; a message
carries the descriptor it came by (ZMQ_SRCFD). So the frontend files each connection that
waits for a request under its descriptor, and a close of that descriptor names the
connections to give up on.

The kernel hands a closed descriptor's number to the next connection. libzmq queues
ACCEPTED before a connection can carry a message, and DISCONNECTED before it closes the
descriptor, so when a message is read every event of its descriptor up to the message's
connection is in the monitor's queue: ``watch`` reads the queue first. It then never files
a new connection under an old one's close, and it tells a message whose own connection has
closed since (a client that sent and left at once: most are read after their close) by its
descriptor's last event. Only a message read after its connection's descriptor was reused
by another is filed under that one: the next close there gives it up, or its reply finds
no way there (the client outbox says so too).
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
_ACCEPTED = int(zmq.EVENT_ACCEPTED)
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
            router.monitor(address, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        except BaseException:
            self.monitor.close()
            raise
        self._router = router
        self._on_closed = on_closed  # a watched connection closed (its identity)
        self._by_fd: dict[int, set[bytes]] = {}
        self._fd_of: dict[bytes, int] = {}
        # Descriptors whose last event was a close (none accepted on the number since): at
        # most one entry a descriptor number the process ever had.
        self._closed: set[int] = set()

    def __enter__(self) -> ClientConnections:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._router.disable_monitor()
        self.monitor.close()

    def watch(self, identity: bytes, fd: int) -> bool:
        """File ``identity``'s connection under ``fd``, the descriptor its latest message came
        by; False if that connection has closed already, and nothing is filed."""
        if fd < 0 or self._fd_of.get(identity) == fd:
            return True  # filed already (a close not yet read will find it); or a transport without one
        self.read()  # every event already queued about ``fd``: its last says whether it is open
        if fd in self._closed:
            return False
        # Filed under another descriptor, if at all: a client that reconnected under a fixed
        # routing id, whose old connection's close must not end what it now asks.
        self.unwatch(identity)
        self._fd_of[identity] = fd
        self._by_fd.setdefault(fd, set()).add(identity)
        return True

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
        """One monitor event: an accept marks its descriptor open; a close gives up on every
        connection filed under its descriptor."""
        event, fd = _EVENT.unpack_from(frames[0])
        if event == _ACCEPTED:
            self._closed.discard(fd)
            return
        self._closed.add(fd)
        for identity in self._by_fd.pop(fd, ()):
            del self._fd_of[identity]
            self._on_closed(identity)
