"""DaemonLink: which connection each of a worker's messages leaves on."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import zmq

from orchestrator.daemon_link import DaemonLink
from transfer.protocol import WORKER_MESSAGE, Done, Heartbeat, Leaving, RegisterRefused, Stopped, TensorSpec, encode

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


async def test_a_hand_over_nobody_answers_ends_at_its_deadline_and_heartbeats_until_then(tmp_path: Path) -> None:
    """A daemon that reads but never answers the Leaving (dead ones read nothing at all):
    the stopping decoder gives up at ``within_s``, having kept its main connection alive."""
    with linked(tmp_path) as (daemon, link):
        link.open_outputs(KEY)
        output = [encode(Done(request_id="r1", ok=True, compute_ms=1.0, outputs=[IMAGE])), b"abc"]
        started = time.monotonic()
        assert await link.hand_over([output], heartbeat_s=0.05, within_s=0.5) == "no answer within 0.5s"
        took_s = time.monotonic() - started
        link.close(0)
        got = heard(daemon)
    assert 0.5 <= took_s < 1.5
    assert [kind for routing_id, kind in got if routing_id == KEY] == ["Done", "Leaving"]
    assert 5 <= sum(kind == "Heartbeat" for routing_id, kind in got if routing_id != KEY) <= 12


async def test_a_hand_over_ends_when_the_daemon_answers_the_leaving(tmp_path: Path) -> None:
    with linked(tmp_path) as (daemon, link):
        outputs = link.open_outputs(KEY)
        assert outputs is link.outputs
        answered = anyio.Event()

        async def answer_the_leaving() -> None:
            while True:
                routing_id, body = await anyio.to_thread.run_sync(daemon.recv_multipart)
                if routing_id == KEY and isinstance(WORKER_MESSAGE.decode(body), Leaving):
                    daemon.send_multipart([KEY, encode(RegisterRefused(message="decoder-1 left"))])
                    answered.set()
                    return

        async with anyio.create_task_group() as tg:
            tg.start_soon(answer_the_leaving)
            with anyio.fail_after(5):
                assert await link.hand_over([], heartbeat_s=10.0, within_s=30.0) is None
            assert answered.is_set()


@contextmanager
def outputs_to_a_dead_daemon(tmp_path: Path) -> Iterator[DaemonLink]:
    """A link whose output connection (under ``KEY``) was up when its daemon died."""
    endpoint = f"ipc://{tmp_path}/workers"
    with zmq.Context() as ctx:
        daemon = ctx.socket(zmq.ROUTER)
        daemon.bind(endpoint)
        link = DaemonLink(endpoint)
        try:
            link.connect()
            link.open_outputs(KEY)
            assert link.send_now([], [[encode(Heartbeat())]], leaving=False)
            assert daemon.poll(5000) and daemon.recv_multipart()[0] == KEY  # the output connection is up
            daemon.close(linger=0)
            yield link
        finally:
            link.close(0)


async def test_a_hand_over_to_a_daemon_that_is_gone_ends_once_no_answer_can_come(tmp_path: Path) -> None:
    """A dead daemon's decoder waited its whole stop_flush_s (10 s) to stop, though ZMQ
    drops what was queued on a connection with it, and no answer could come."""
    with outputs_to_a_dead_daemon(tmp_path) as link:
        started = time.monotonic()
        with anyio.fail_after(5):
            why = await link.hand_over([], heartbeat_s=0.05, within_s=30.0)
        assert why is not None and "closed" in why and time.monotonic() - started < 2


async def test_a_hand_over_where_no_daemon_ever_listened_ends_after_the_wait_for_one(tmp_path: Path) -> None:
    link = DaemonLink(f"ipc://{tmp_path}/nobody")
    try:
        link.connect()
        link.open_outputs(KEY)
        with anyio.fail_after(10):
            why = await link.hand_over([], heartbeat_s=0.05, within_s=30.0)
        assert why is not None and why.startswith(f"no daemon at ipc://{tmp_path}/nobody")
    finally:
        link.close(0)
