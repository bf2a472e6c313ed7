"""Reading a ZMQ socket from the event loop without zmq.asyncio (daemon and workers)."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import anyio.lowlevel
import zmq

# Messages taken back to back before letting other tasks run.
PUMP_BATCH = 64


class PlainPump:
    """Reads a plain socket from the event loop: waits for its FD, then takes what is queued.

    Cheaper than zmq.asyncio's future and callbacks per message. ZMQ's FD is edge-triggered
    and only says "re-read ZMQ_EVENTS", so the loop re-checks EVENTS before every wait.
    ``on_frames`` may send on the socket (that happens before the check). A send from any
    other task can swallow the edge, so such a task must call ``after_send`` to wake the loop.
    """

    def __init__(self, sock: zmq.Socket, on_frames: Callable[[list], None], *, copy: bool) -> None:
        self._sock = sock
        self._on_frames = on_frames
        self._copy = copy  # False: zmq.Frame objects that can be relayed without a copy
        self._waiting: anyio.CancelScope | None = None

    async def run(self) -> None:
        sock, fd = self._sock, self._sock.getsockopt(zmq.FD)
        while True:
            taken = 0
            while taken < PUMP_BATCH and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._on_frames(sock.recv_multipart(zmq.NOBLOCK, copy=self._copy))
                taken += 1
            if taken == PUMP_BATCH:
                await anyio.lowlevel.checkpoint()  # let other tasks run during a burst
                continue
            with anyio.CancelScope() as self._waiting:
                await anyio.wait_readable(fd)
            self._waiting = None

    def after_send(self) -> None:
        if self._waiting is not None and self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._waiting.cancel()
