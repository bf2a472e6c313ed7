"""ClientConnections over a real ROUTER and real client connections (plain sockets, no loop)."""

from __future__ import annotations

import subprocess
import sys
import time
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

    def until_closed(self, fd: int) -> None:
        """Read the monitor's events until one says ``fd`` closed."""
        deadline = time.monotonic() + 5
        while fd not in self.connections._closed:
            assert time.monotonic() < deadline, f"no close of descriptor {fd} heard"
            self.connections.monitor.poll(100)
            self.connections.read()

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
        assert r.connections.watch(ida, fda) and r.connections.watch(idb, fdb)
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
        assert r.connections.watch(idb, fdb)
        assert r.closed == [ida]
        b.send(b"still here")
        assert r.sock.poll(5000)
        assert r.closed == [ida]
        b.close()
        r.wait_for_close_event()
        r.connections.read()
        assert r.closed == [ida, idb]


def test_a_message_read_after_its_own_connection_closed_is_told_and_not_filed(ctx: zmq.Context,
                                                                           tmp_path: Path) -> None:
    """A client that sent and left at once: its close is queued before its message is read
    (most are), so nothing would ever say it closed again."""
    with router(ctx, tmp_path) as r:
        a = r.client()
        ida, fda = r.heard_from(a)
        a.close()
        r.until_closed(fda)  # as the frontend's reader would have, or ``watch`` does
        assert not r.connections.watch(ida, fda)
        b = r.client()  # the number reused: filed, and its close is its own
        idb, fdb = r.heard_from(b)
        assert fdb == fda and r.connections.watch(idb, fdb)
        b.close()
        r.wait_for_close_event()
        r.connections.read()
        assert r.closed == [idb]


def test_an_identity_heard_by_another_connection_is_filed_under_that_one(ctx: zmq.Context, tmp_path: Path) -> None:
    """A client that reconnects under a fixed routing id: its old connection's close must not
    end what it asks by the new one."""
    with router(ctx, tmp_path) as r:
        old, new = r.client(), r.client()
        (_, fd_old), (_, fd_new) = r.heard_from(old), r.heard_from(new)
        assert r.connections.watch(b"fixed", fd_old) and r.connections.watch(b"fixed", fd_new)
        old.close()
        r.wait_for_close_event()
        r.connections.read()
        assert r.closed == []
        new.close()
        r.wait_for_close_event()
        r.connections.read()
        assert r.closed == [b"fixed"]


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


def test_no_socket_of_ours_turns_on_zmtp_heartbeats() -> None:
    """libzmq 4.3.5 aborts the whole process when a heartbeat falls due on a connection
    whose input it stopped (its queue full) and whose peer closed (transfer/binding.py): a
    client that floods the daemon and leaves would end it. Reproduced here: exit 134,
    `Assertion failed: !_io_error (src/stream_engine_base.cpp:310)`."""
    root = Path(__file__).parents[2]
    found = [f"{path.relative_to(root)}:{n}" for package in ("orchestrator", "actors", "transfer")
             for path in sorted((root / package).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if "zmq.HEARTBEAT_" in line]
    assert not found
