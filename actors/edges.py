"""Binding the daemon's sockets: an endpoint in use is an error, never silently taken over."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio
import anyio.lowlevel
import zmq


class EndpointInUse(OSError):
    pass


def bind_exclusive(sock: zmq.Socket, endpoint: str) -> str:
    """Bind ``endpoint`` and return the bound address (with the real port for ``:0``/``*``).

    TCP refuses a taken port by itself (EADDRINUSE). An ``ipc://`` path does not: ZMQ
    unlinks the file and binds anew, stealing the endpoint from a daemon still running
    there. So a live listener on the path is detected first and refused.
    """
    if endpoint.startswith("ipc://"):
        path = endpoint.removeprefix("ipc://")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            pass  # nothing listening: a stale file or no file, safe to bind
        else:
            raise EndpointInUse(f"Address already in use: {endpoint} has a live listener")
        finally:
            probe.close()
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


@contextmanager
def bound_router(ctx: zmq.Context, endpoint: str, *, send_hwm: int, close_linger_ms: int = 0,
                 plain: bool = False) -> Iterator[tuple[zmq.Socket, str]]:
    """A ROUTER bound exclusively to ``endpoint``, closed on exit; yields it and its address.

    ``plain`` makes a plain socket even under an asyncio context, for ``pump_plain``.
    """
    sock = zmq.Socket(ctx, zmq.ROUTER) if plain else ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, send_hwm)
    try:
        yield sock, bind_exclusive(sock, endpoint)
    finally:
        sock.close(linger=close_linger_ms)


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
