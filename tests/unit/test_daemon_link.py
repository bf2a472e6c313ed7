"""DaemonLink: which connection each of a worker's messages leaves on."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import zmq

from orchestrator.daemon_link import DaemonLink
from transfer.protocol import WORKER_MESSAGE, Done, Heartbeat, Stopped, TensorSpec, encode

KEY = b"k" * 16
IMAGE = TensorSpec(name="image", dtype="uint8", shape=(3,), nbytes=3)


@contextmanager
def linked(tmp_path: Path) -> Iterator[tuple[zmq.Socket, DaemonLink]]:
    """A daemon's ROUTER and a connected DaemonLink; the link is closed (a second's linger
    for what it queued) before the daemon's socket."""
    endpoint = f"ipc://{tmp_path}/workers"
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as daemon:
        daemon.bind(endpoint)
        link = DaemonLink(endpoint)
        try:
            link.connect()
            yield daemon, link
        finally:
            link.close(1000)


def heard(daemon: zmq.Socket) -> list[tuple[bytes, str]]:
    """(routing id, first body's kind) of every message the daemon's socket got."""
    messages = []
    while daemon.poll(1000):
        routing_id, body, *_ = daemon.recv_multipart()
        messages.append((routing_id, type(WORKER_MESSAGE.decode(body)).__name__))
    return messages


def test_a_decoders_outputs_and_its_leaving_go_on_the_connection_its_key_names(tmp_path: Path) -> None:
    with linked(tmp_path) as (daemon, link):
        link.open_outputs(b"old key" * 2)
        link.close_outputs()  # forgotten: a new registration opens another
        link.open_outputs(KEY)
        output = [encode(Done(request_id="r1", ok=True, compute_ms=1.0, outputs=[IMAGE])), b"abc"]
        assert link.send_now([[encode(Stopped(request_id="r0", ack=1))]], [output], leaving=True)
        link.close(1000)
        got = heard(daemon)
    main = [kind for routing_id, kind in got if routing_id != KEY]
    assert main == ["Stopped"]
    assert [kind for routing_id, kind in got if routing_id == KEY] == ["Done", "Leaving"]  # in that order


def test_without_an_output_connection_everything_goes_on_the_main_one(tmp_path: Path) -> None:
    with linked(tmp_path) as (daemon, link):
        assert link.send_now([[encode(Heartbeat())]], [], leaving=True)
        link.close(1000)
        got = heard(daemon)
    assert [kind for _, kind in got] == ["Heartbeat", "Leaving"] and len({routing_id for routing_id, _ in got}) == 1


def test_leaving_is_not_said_unless_asked(tmp_path: Path) -> None:
    with linked(tmp_path) as (daemon, link):
        link.open_outputs(KEY)
        assert link.send_now([], [], leaving=False)
        link.close(1000)
        assert not daemon.poll(200)
