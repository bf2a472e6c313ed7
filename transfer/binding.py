"""Binding sockets, the daemon's and a worker's work socket: an endpoint in use is an error, never
silently taken over."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import zmq

# How long a closing socket may take to send what was handed to it last (answers, farewells).
FLUSH_ON_CLOSE_MS = 1000


class EndpointUnusable(OSError):
    """An endpoint this process cannot bind (in use, malformed, or not an address of this
    host), or cannot connect to (malformed, or ``*``)."""


def bind(sock: zmq.Socket, endpoint: str) -> None:
    """``sock.bind(endpoint)``, a failure raised as ``EndpointUnusable`` naming the endpoint."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        why = {
            # ZMQ's word for a host it cannot resolve to one of this machine's interfaces.
            errno.ENODEV: " (no address or interface of this host by that name)",
            errno.EADDRINUSE: " (another process listens there: a daemon already running?)",
        }.get(exc.errno, "")
        # zmq.strerror: the bare reason (newer pyzmq's exc.strerror repeats the address).
        raise EndpointUnusable(f"{zmq.strerror(exc.errno)}: {endpoint}{why}") from exc


def bind_exclusive(sock: zmq.Socket, endpoint: str) -> str:
    """Bind ``endpoint`` and return the bound address (with the real port for ``:0``/``*``).

    TCP refuses a taken port by itself (EADDRINUSE). An ``ipc://`` path does not: ZMQ
    unlinks the file and binds anew, stealing the endpoint from a daemon still running
    there. So a live listener on the path is detected first and refused.
    """
    if endpoint.startswith("ipc://"):
        try:
            live = unix_listener_at(endpoint.removeprefix("ipc://"))
        except OSError:
            live = False  # not a socket one can reach: ZMQ's bind says what is wrong with it
        if live:
            raise EndpointUnusable(f"Address already in use: {endpoint} has a live listener")
    bind(sock, endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def unix_listener_at(path: str) -> bool:
    """Whether a process listens on the Unix socket file ``path``: True if a connection is
    taken or would be (its backlog is full), False if refused or there is no file; any other
    failure (no permission, a path too long) is raised. Never blocks."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except BlockingIOError:
            return True
    return True


@contextmanager
def bound_router(ctx: zmq.Context, endpoint: str, *, send_hwm: int, max_message_bytes: int,
                 close_linger_ms: int = 0, plain: bool = False, mandatory: bool = False
                 ) -> Iterator[tuple[zmq.Socket, str]]:
    """A ROUTER bound exclusively to ``endpoint``, closed on exit; yields it and its address.

    A peer that sends a frame over ``max_message_bytes`` is disconnected by ZMQ before the
    frame is buffered whole. The limit is per frame: ZMQ has none on a message's frame
    count, and it gathers a whole message before handing any of it over, so a peer sending
    many frames can still make this process hold them all (docs/operations.md, Security).
    ``plain`` makes a plain socket even under an asyncio context, for a ``PlainPump``;
    ``mandatory`` makes a send that ZMQ would silently drop (peer gone, or past its
    high-water mark) raise instead.

    No ZMTP heartbeats (ZMQ_HEARTBEAT_IVL): libzmq 4.3.5 aborts the whole process when a
    heartbeat falls due on a connection whose input it stopped (its queue full: a peer
    flooding a loop that reads slower) and whose peer has closed (stream_engine_base.cpp:310,
    `!_io_error`; reproduced here).
    """
    sock = zmq.Socket(ctx, zmq.ROUTER) if plain else ctx.socket(zmq.ROUTER)
    try:
        # Closed on any failure, an option's too: a plain socket left open keeps the
        # context's term() waiting for ever.
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, send_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if mandatory:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        bound = bind_exclusive(sock, endpoint)
    except BaseException:
        sock.close(linger=0)  # and the endpoint's file, if any, is another process's: left
        raise
    try:
        yield sock, bound
    finally:
        sock.close(linger=close_linger_ms)
        remove_ipc_file(endpoint)  # the next bind would reuse it, but a stopped daemon leaves nothing


def remove_ipc_file(endpoint: str | None) -> None:
    """Remove the file of an ``ipc://`` endpoint this process bound, which ZMQ leaves behind
    (nothing for tcp, or None)."""
    if endpoint is not None and endpoint.startswith("ipc://"):
        Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)
