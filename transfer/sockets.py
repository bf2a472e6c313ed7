"""Reading a ZMQ socket from the event loop: plain sockets without zmq.asyncio (daemon and workers), and
an asyncio one's message without holding the loop however many frames it has."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import anyio
import zmq
import zmq.asyncio

# Messages taken back to back before letting the rest of the loop run.
PUMP_BATCH = 64
# Frames of an overlong message dropped back to back before letting the rest of the loop run
# (a few ms: an empty frame takes about 0.6 µs to drop).
SKIP_BATCH = 4096

# pyzmq's constants are enums, and every call with one goes through Python's enum machinery
# (about 1.5 µs of a budget of a few µs per message); the hot paths use the plain ints.
EVENTS = int(zmq.EVENTS)
POLLIN = int(zmq.POLLIN)
NOBLOCK = int(zmq.NOBLOCK)
SNDMORE = int(zmq.SNDMORE)
SRCFD = int(zmq.SRCFD)  # a message's property: the descriptor of the connection it came by


# pyzmq's send_multipart and recv_multipart cost 3-4 µs a message in Python around the C
# calls: a type check per part, enum arithmetic per part, a getsockopt(RCVMORE) per part.
# These do the same work in about a third of that.


def send_frames(sock: zmq.Socket, parts: Sequence[Any], flags: int = 0, *, copy: bool = True) -> None:
    """``sock.send_multipart(parts, flags, copy=copy)`` for bytes or ``zmq.Frame`` parts."""
    send = sock.send
    last = len(parts) - 1
    for i in range(last):
        send(parts[i], SNDMORE | flags, copy=copy)
    send(parts[last], flags, copy=copy)


def recv_frames(sock: zmq.Socket, *, copy: bool) -> list[Any]:
    """One whole message, without blocking: ``zmq.Frame`` objects, or bytes with ``copy``."""
    recv = sock.recv
    frame = recv(NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:
        frame = recv(NOBLOCK, copy=False)
        frames.append(frame)
    return [f.bytes for f in frames] if copy else frames


def recv_head(sock: zmq.Socket, *, copy: bool, most: int) -> tuple[list[Any], bool]:
    """A message's first ``most`` frames (as ``recv_frames``), and whether more of it follow:
    those are the caller's to read or drop (``skip_frames``) before the next message."""
    recv = sock.recv
    frame = recv(NOBLOCK, copy=False)
    frames = [frame]
    while frame.more and len(frames) < most:
        frame = recv(NOBLOCK, copy=False)
        frames.append(frame)
    return ([f.bytes for f in frames] if copy else frames), frame.more


def skip_frames(sock: zmq.Socket, batch: int) -> bool:
    """Drop up to ``batch`` frames of the message under way, unread; True once its last is gone."""
    recv = sock.recv
    for _ in range(batch):
        if not recv(NOBLOCK, copy=False).more:
            return True
    return False


async def recv_cut(sock: zmq.asyncio.Socket, most: int) -> list[bytes]:
    """An asyncio socket's next message, as its first ``most`` frames: any more are dropped
    unread, ``SKIP_BATCH`` frames a turn (see ``PlainPump``). Its ``recv_multipart`` would
    read every frame in one go, holding the loop."""
    await sock.poll(flags=zmq.POLLIN)
    plain = zmq.Socket.shadow(sock.underlying)  # the same socket, read without a future per frame
    frames, more = recv_head(plain, copy=True, most=most)
    while more:
        await anyio.sleep(0)
        more = not skip_frames(plain, SKIP_BATCH)
    return frames


class PlainPump:
    """Reads a plain socket from the event loop: a reader callback on its FD takes what is queued.

    Cheaper than zmq.asyncio's future and callbacks per message, and than a task that
    waits on the FD: the reader stays registered, so a wake-up costs no epoll_ctl calls.
    ZMQ's FD is edge-triggered and only says "re-read ZMQ_EVENTS", so the reader takes
    messages until EVENTS shows none. A send takes in whatever arrived, and with it the edge:
    ``on_frames`` may send (the check comes after); a send from anywhere else must call
    ``after_send``, or what arrived waits for an edge that never comes.
    This is asyncio-specific on purpose: the daemon and workers run on anyio's asyncio backend.

    With ``most_frames``, a message of more frames reaches ``on_frames`` as its first
    ``most_frames``, once the rest is dropped unread, ``SKIP_BATCH`` frames a turn. ZMQ's
    frame limit (MAXMSGSIZE) is per frame, so a peer can send one message of millions of
    empty frames: read whole, it held the loop, and every other socket and timer, for seconds.
    """

    def __init__(self, sock: zmq.Socket, on_frames: Callable[[list], None], *, copy: bool,
                 hold: Callable[[], AbstractContextManager[object]] = nullcontext,
                 most_frames: int | None = None) -> None:
        self._sock = sock
        self._on_frames = on_frames
        self._hold = hold  # wraps each batch: the daemon's switchboard delivers it as one
        self._copy = copy  # False: zmq.Frame objects that can be relayed without a copy
        self._most_frames = most_frames
        self._cut: list | None = None  # the first frames of a message whose rest is being dropped
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Future[None] | None = None
        self._rescheduled = False

    async def run(self) -> None:
        """Read until cancelled; an exception from ``on_frames`` ends the pump and is raised here."""
        self._loop = loop = asyncio.get_running_loop()
        self._stopped = loop.create_future()
        fd = self._sock.getsockopt(zmq.FD)
        loop.add_reader(fd, self._read)
        try:
            self._read()  # messages that arrived before the reader was registered
            await self._stopped
        finally:
            loop.remove_reader(fd)
            self._loop = None

    @property
    def mid_message(self) -> bool:
        """Whether the socket's next frame is within an overlong message, not a message's first."""
        return self._cut is not None

    def after_send(self) -> None:
        if self._loop is not None and not self._rescheduled and self._sock.getsockopt(EVENTS) & POLLIN:
            self._reschedule()

    def _reschedule(self) -> None:
        assert self._loop is not None
        self._rescheduled = True
        self._loop.call_soon(self._read)

    def _read(self) -> None:
        self._rescheduled = False
        if self._stopped is None or self._stopped.done():
            return
        sock = self._sock
        try:
            with self._hold():
                for _ in range(PUMP_BATCH):
                    if self._cut is None:
                        if not sock.getsockopt(EVENTS) & POLLIN:
                            return
                        if self._most_frames is None:
                            self._on_frames(recv_frames(sock, copy=self._copy))
                            continue
                        frames, more = recv_head(sock, copy=self._copy, most=self._most_frames)
                        if not more:
                            self._on_frames(frames)
                            continue
                        self._cut = frames
                    if not skip_frames(sock, SKIP_BATCH):
                        break  # more of it next turn
                    frames, self._cut = self._cut, None
                    self._on_frames(frames)
            self._reschedule()  # a burst: let timers and other sockets have a turn first
        except BaseException as exc:  # a reader callback's error would only be logged by asyncio
            self._stopped.set_exception(exc)
