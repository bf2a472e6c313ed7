"""ClientConnections over a real ROUTER and real client connections (plain sockets, no loop)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from actors.client_connections import ClientConnections
from transfer.sockets import SRCFD


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


class Router:
    """A bound ROUTER, its ClientConnections, and the identities it said closed."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.closed: list[bytes] = []
        self.connections = ClientConnections(ctx, self.sock, self.closed.append)

    def client(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        return sock

    def heard_from(self, client: zmq.Socket) -> tuple[bytes, int]:
        """Send from ``client``; the identity and descriptor its message reaches the ROUTER with."""
        client.send(b"submit")
        assert self.sock.poll(5000)
        head = self.sock.recv(copy=False)
        assert self.sock.recv() == b"submit"
        return head.bytes, head.get(SRCFD)

    def wait_for_close_event(self) -> None:
        """Until the monitor has a close queued (unread: ``watch`` or ``read`` takes it in)."""
        assert self.connections.monitor.poll(5000)


@contextmanager
def router(ctx: zmq.Context, tmp_path: Path) -> Iterator[Router]:
    r = Router(ctx, f"ipc://{tmp_path}/clients")
    try:
        yield r
    finally:
        r.connections.__exit__(None, None, None)
        r.sock.close()


def test_a_watched_connection_that_closes_is_named_once(ctx: zmq.Context, tmp_path: Path) -> None:
    with router(ctx, tmp_path) as r:
        a, b = r.client(), r.client()
        (ida, fda), (idb, fdb) = r.heard_from(a), r.heard_from(b)
        assert fda >= 0 and fda != fdb
        r.connections.watch(ida, fda)
        r.connections.watch(idb, fdb)
        a.close()
        r.wait_for_close_event()
        r.connections.read()
        assert r.closed == [ida]
        b.close()
        r.wait_for_close_event()
        r.connections.read()
        assert r.closed == [ida, idb]


def test_a_connection_no_longer_watched_closes_unnoticed(ctx: zmq.Context, tmp_path: Path) -> None:
    with router(ctx, tmp_path) as r:
        a = r.client()
        ida, fda = r.heard_from(a)
        r.connections.watch(ida, fda)
        r.connections.unwatch(ida)
        r.connections.unwatch(ida)  # twice: as after a close the monitor reported first
        a.close()
        r.wait_for_close_event()
        r.connections.read()
        assert r.closed == []


def test_a_new_connection_on_a_closed_ones_descriptor_is_not_given_up_with_it(ctx: zmq.Context,
                                                                             tmp_path: Path) -> None:
    """The kernel reuses the number at once; the old close, still unread when the new
    connection's message is, is taken in before the new connection is filed."""
    with router(ctx, tmp_path) as r:
        a = r.client()
        ida, fda = r.heard_from(a)
        r.connections.watch(ida, fda)
        a.close()
        r.wait_for_close_event()  # queued, not read
        b = r.client()
        idb, fdb = r.heard_from(b)
        assert fdb == fda  # the number reused: what this test is about
        r.connections.watch(idb, fdb)
        assert r.closed == [ida]
        b.send(b"still here")
        assert r.sock.poll(5000)
        assert r.closed == [ida]
        b.close()
        r.wait_for_close_event()
        r.connections.read()
        assert r.closed == [ida, idb]


def test_closes_nobody_reads_never_stall_the_router(tmp_path: Path) -> None:
    """libzmq's I/O thread blocks on a full monitor queue, and every socket with it; this
    one has no limit, so a loop that cannot read for a while stalls nothing. In a process
    of its own: a stalled I/O thread would hang this one's every socket, and its exit."""
    flood = subprocess.run([sys.executable, "-c", f"from tests.unit.test_client_connections import flood; "
                                                  f"flood({str(tmp_path)!r})"], timeout=60, capture_output=True)
    assert flood.returncode == 0, flood.stderr.decode()[-2000:]


def flood(tmp_path: str) -> None:
    """2,500 connections close, past ZMQ's default queue of 1,000 each side, and nobody reads
    the monitor: the ROUTER still takes connections and messages."""
    ctx = zmq.Context()
    with router(ctx, Path(tmp_path)) as r:
        for _ in range(2500):
            c = r.client()
            r.heard_from(c)
            c.close()
        last = r.client()
        r.heard_from(last)
        last.close()
    ctx.term()
