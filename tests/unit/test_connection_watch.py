"""ConnectionWatch: what a client's socket monitor says about the daemon at its other end."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest
import zmq

from orchestrator.connection_watch import ConnectionWatch

ENDPOINT = "tcp://127.0.0.1:5555"


def event(kind: int) -> list[bytes]:
    """One monitor message, as ZMQ frames it."""
    return [struct.pack("=hi", kind, 0), ENDPOINT.encode()]


@pytest.fixture
def watch() -> Iterator[ConnectionWatch]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    watch = ConnectionWatch(sock)
    yield watch
    watch.close()
    sock.close(linger=0)
    ctx.term()


def test_silence_at_a_tcp_endpoint_names_what_zmq_cannot_tell_apart(watch: ConnectionWatch) -> None:
    """An unknown host name waits as silently as an empty port."""
    assert watch.why_none("tcp://no-such-host:5555", 3.0) == (
        "no daemon at tcp://no-such-host:5555: nothing there took a connection within 3s "
        "(nothing listens there, or its host is unreachable or unknown)")


def test_what_accepts_a_connection_but_never_shakes_hands_is_told_from_nothing(watch: ConnectionWatch) -> None:
    assert watch.why_none(ENDPOINT, 3.0).startswith(f"no daemon at {ENDPOINT}: nothing there took a connection "
                                                    "within 3s")
    watch.heard(event(zmq.EVENT_CONNECTED))  # a stopped daemon's kernel still accepts
    assert watch.why_none(ENDPOINT, 3.0).startswith(f"no daemon answers at {ENDPOINT}: something there took the "
                                                    "connection but did not complete ZMQ's handshake within 3s")


def test_a_daemon_that_left_is_not_taken_for_a_stopped_one(watch: ConnectionWatch) -> None:
    """Once its connection is lost, only what accepts one since counts: an empty port is "nothing there"."""
    for kind in (zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED):
        watch.heard(event(kind))
    assert (watch.connected, watch.closes) == (False, 1)
    assert watch.why_none(ENDPOINT, 3.0).startswith(f"no daemon at {ENDPOINT}: nothing there")
