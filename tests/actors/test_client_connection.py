"""Both clients against a daemon that is not there, or goes: a request that can get no answer
fails at once with ConnectionError, never after its whole deadline in silence."""

from __future__ import annotations

import asyncio
import threading
import time
from functools import partial
from pathlib import Path

import anyio
import pytest
import zmq
import zmq.asyncio

from actors.mail import Admit
from orchestrator.client import AsyncClient, Client
from orchestrator.control_client import Control
from tests.actors.fake_daemon import router_at
from tests.actors.test_frontend import running_frontend
from transfer.protocol import (
    CLIENT_REQUEST,
    Cancel,
    GenParams,
    Reason,
    Rejected,
    Result,
    Submit,
    encode,
)

PARAMS = GenParams(prompt="p")
NO_DAEMON_S = 1.0  # the clients' wait for a daemon, shortened here (3 s in use)


@pytest.fixture(autouse=True)
def quick_to_say_no_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("orchestrator.connection_watch.NO_DAEMON_S", NO_DAEMON_S)


async def test_an_async_submit_where_no_daemon_listens_fails_after_the_wait_for_one(tmp_path: Path) -> None:
    """The wait counts from the request's sending, not from the client's opening."""
    with anyio.fail_after(10):
        async with AsyncClient(f"ipc://{tmp_path}/nobody") as client:
            await anyio.sleep(NO_DAEMON_S / 2)
            started = time.monotonic()
            with pytest.raises(ConnectionError, match=rf"no daemon at ipc://.*/nobody: nothing there took a "
                                                      rf"connection within {NO_DAEMON_S:g}s"):
                await client.submit(PARAMS, timeout_s=60)
            assert NO_DAEMON_S - 0.2 < time.monotonic() - started < NO_DAEMON_S + 1.5


async def test_submits_past_what_zmq_queues_for_an_absent_daemon_fail_as_soon_as_the_others(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """A DEALER queues 1,000 messages for a daemon not there; a send past that waits. Such a
    submit fails like the others, after the wait for a daemon, not at its deadline; it was
    never sent, so it leaves no Cancel behind and its id is free at once."""
    endpoint = f"ipc://{tmp_path}/later"
    with anyio.fail_after(20):
        async with AsyncClient(endpoint) as client:
            failed: list[float] = []
            started = time.monotonic()

            async def submit(rid: str) -> None:
                with pytest.raises(ConnectionError, match="nothing there took a connection"):
                    await client.submit(PARAMS, request_id=rid, timeout_s=60)
                failed.append(time.monotonic() - started)

            async with anyio.create_task_group() as tg:
                for i in range(1100):
                    tg.start_soon(submit, f"r{i}")
            assert len(failed) == 1100 and max(failed) < NO_DAEMON_S + 2.0
            daemon = router_at(ctx, endpoint)  # back: it hears what was queued, nothing more
            try:
                heard: list[tuple[type, str]] = []
                with anyio.move_on_after(2.0):
                    while True:
                        _, _, body = await daemon.recv_multipart()
                        message = CLIENT_REQUEST.decode(body)
                        heard.append((type(message), message.request_id))
                submitted = {rid for kind, rid in heard if kind is Submit}
                cancelled = {rid for kind, rid in heard if kind is Cancel}
                assert len(heard) == 1000 and submitted and cancelled <= submitted
                unsent = next(f"r{i}" for i in range(1100) if f"r{i}" not in submitted)
                with pytest.raises(ValueError, match="in use"):  # a sent one may still be answered
                    await client.submit(PARAMS, request_id=next(iter(submitted)), timeout_s=60)
                async with anyio.create_task_group() as tg:  # an unsent one's id is free
                    tg.start_soon(partial(client.submit, PARAMS, request_id=unsent, timeout_s=60))
                    while True:
                        identity, _, body = await daemon.recv_multipart()
                        if CLIENT_REQUEST.decode(body).request_id == unsent:
                            break
                    await daemon.send_multipart([identity, b"", encode(Result(request_id=unsent, outputs=[],
                                                                              stages=[], total_ms=1.0))])
            finally:
                daemon.close(linger=0)


async def test_a_submit_sent_as_its_connection_closed_never_reaches_the_next_daemon(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """ZMQ saw the daemon go before the client's watch did: a Submit sent meanwhile waits in
    the socket's queue, and ZMQ would hand it to the next daemon, whose answer a retry under
    the id would take. The client replaces its socket when a connection closes: that Submit
    goes with the old one, the request fails as lost, and its id is free at once."""
    endpoint = f"ipc://{tmp_path}/daemon"
    with anyio.fail_after(15):
        async with AsyncClient(endpoint) as client, anyio.create_task_group() as tg:
            first = router_at(ctx, endpoint)
            answers: list[float] = []

            async def submit() -> None:
                answers.append((await client.submit(PARAMS, request_id="X", timeout_s=30)).result.total_ms)

            while not (client._watch and client._watch.connected):
                await anyio.sleep(0.01)
            first.close(linger=0)
            time.sleep(0.3)  # the loop busy: ZMQ has seen the close, the watch not yet
            with pytest.raises(ConnectionError, match="closed while the request waited"):
                await client.submit(PARAMS, request_id="X", timeout_s=30)
            second = router_at(ctx, endpoint)
            try:
                tg.start_soon(submit)
                identity, _, body = await second.recv_multipart()
                assert isinstance(CLIENT_REQUEST.decode(body), Submit)  # the retry, and nothing before it
                await second.send_multipart([identity, b"", encode(Result(request_id="X", outputs=[], stages=[],
                                                                          total_ms=222.0))])
                while not answers:
                    await anyio.sleep(0.01)
                assert not await second.poll(200)  # and nothing more: the old Submit went with its socket
            finally:
                second.close(linger=0)
    assert answers == [222.0]


async def test_an_id_sent_where_no_daemon_listens_is_held_until_a_daemon_ends_it(
    ctx: zmq.asyncio.Context, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its Submit waits in ZMQ's queue, and a daemon that comes, however late, gets it (and
    its Cancel) first: a new request under the id meanwhile would be refused as a duplicate,
    or take the old one's end. It is refused at the client until that end comes."""
    monkeypatch.setattr("orchestrator.client_wire.GRACE_S", 0.05)
    endpoint = f"ipc://{tmp_path}/later"
    with anyio.fail_after(15):
        async with AsyncClient(endpoint) as client:
            with pytest.raises(ConnectionError, match="nothing there took a connection"):
                await client.submit(PARAMS, request_id="job-7", timeout_s=1.5)
            await anyio.sleep(1.8)  # past its deadline and grace, counted from its failure
            with pytest.raises(ValueError, match="in use"):
                await client.submit(PARAMS, request_id="job-7", timeout_s=60)
            daemon = router_at(ctx, endpoint)
            try:
                heard = [await daemon.recv_multipart() for _ in range(2)]
                assert [type(CLIENT_REQUEST.decode(body)) for _, _, body in heard] == [Submit, Cancel]
                identity = heard[0][0]
                await daemon.send_multipart([identity, b"", encode(Rejected(
                    request_id="job-7", reason=Reason.CANCELLED, message="cancelled by the client"))])
                await anyio.sleep(0.1)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(partial(client.submit, PARAMS, request_id="job-7", timeout_s=60))
                    _, _, body = await daemon.recv_multipart()
                    assert CLIENT_REQUEST.decode(body).timeout_s == 60
                    await daemon.send_multipart([identity, b"", encode(Result(request_id="job-7", outputs=[],
                                                                              stages=[], total_ms=1.0))])
            finally:
                daemon.close(linger=0)


async def test_an_id_held_for_a_daemon_to_come_is_held_for_its_wait_once_one_took_it(
    ctx: zmq.asyncio.Context, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon takes the queued Submit and its Cancel, then dies before answering (a crash
    loop): the id must not stay in use for good (nor its hold in the client's memory)."""
    monkeypatch.setattr("orchestrator.client_wire.GRACE_S", 0.05)
    endpoint = f"ipc://{tmp_path}/flaky"
    with anyio.fail_after(20):
        async with AsyncClient(endpoint) as client:
            with pytest.raises(ConnectionError, match="nothing there took a connection"):
                await client.submit(PARAMS, request_id="job-7", timeout_s=1.5)
            dying = router_at(ctx, endpoint)
            try:
                for kind in (Submit, Cancel):
                    _, _, body = await dying.recv_multipart()
                    assert isinstance(CLIENT_REQUEST.decode(body), kind)
            finally:
                dying.close(linger=0)
            with pytest.raises(ValueError, match="in use"):  # an answer could still be on its way
                await client.submit(PARAMS, request_id="job-7", timeout_s=1.5)
            await anyio.sleep(1.6)  # its wait (1.55 s) from when that daemon took the connection
            daemon = router_at(ctx, endpoint)
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(partial(client.submit, PARAMS, request_id="job-7", timeout_s=60))
                    identity, _, _ = await daemon.recv_multipart()
                    await daemon.send_multipart([identity, b"", encode(Result(request_id="job-7", outputs=[],
                                                                              stages=[], total_ms=1.0))])
            finally:
                daemon.close(linger=0)


@pytest.mark.parametrize("close_after_s", [NO_DAEMON_S / 4, NO_DAEMON_S * 1.6])
async def test_closing_the_client_under_a_send_that_waits_fails_that_submit_as_every_other(
    tmp_path: Path, close_after_s: float
) -> None:
    """A submit whose send waits behind ZMQ's full queue, when the client closes, raises
    ConnectionError as the queued ones do (pyzmq cancelled its send: a bare CancelledError);
    so does one failed for want of a daemon, whose Cancel waits behind that queue."""
    outcomes: list[type[BaseException]] = []

    async def submit(client: AsyncClient, rid: str) -> None:
        try:
            await client.submit(PARAMS, request_id=rid, timeout_s=60)
        except Exception as exc:  # a CancelledError is not one: it would go missing here
            outcomes.append(type(exc))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            async with AsyncClient(f"ipc://{tmp_path}/nobody") as client:
                for i in range(1005):
                    tg.start_soon(submit, client, f"r{i}")
                await anyio.sleep(close_after_s)
    assert outcomes == [ConnectionError] * 1005


def test_a_blocking_submit_where_no_daemon_listens_fails_after_the_wait_for_one(tmp_path: Path) -> None:
    """The wait counts from the request's sending; and closing the client twice is fine."""
    with Client(f"ipc://{tmp_path}/nobody") as client:
        time.sleep(NO_DAEMON_S / 2)
        started = time.monotonic()
        with pytest.raises(ConnectionError, match="nothing there took a connection"):
            client.submit(PARAMS, timeout_s=60)
        # Its attempt to cancel the request afterwards waits at most 1 s more.
        assert NO_DAEMON_S - 0.2 < time.monotonic() - started < NO_DAEMON_S + 2.5
        client.close()


def test_the_control_client_where_no_daemon_listens_fails_after_the_wait_for_one(tmp_path: Path) -> None:
    """As the other clients: it waited its whole timeout (10 s) and said only that no reply
    came (a new user's walkthrough of the docs, which promise 'no daemon' within 3 s)."""
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="nothing there took a connection"):
        Control(f"ipc://{tmp_path}/nobody", timeout_s=60).stats()
    assert NO_DAEMON_S - 0.2 < time.monotonic() - started < NO_DAEMON_S + 1.5


async def test_an_async_cancel_where_no_daemon_listens_fails_after_the_wait_for_one(tmp_path: Path) -> None:
    """As its submit, and as the blocking client's cancel: not after its whole timeout."""
    with anyio.fail_after(10):
        async with AsyncClient(f"ipc://{tmp_path}/nobody") as client:
            started = time.monotonic()
            with pytest.raises(ConnectionError, match=rf"no daemon at ipc://.*/nobody: nothing there took a "
                                                      rf"connection within {NO_DAEMON_S:g}s"):
                await client.cancel("r", timeout_s=30)
            assert NO_DAEMON_S - 0.2 < time.monotonic() - started < NO_DAEMON_S + 1.0


async def test_an_async_request_whose_connection_closes_fails_at_once_and_the_client_carries_on(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """The daemon's ROUTER answers the connection a request came by: once it closes, the
    answer cannot come, even from a daemon that is back on the same endpoint. The client
    serves on, its id free at once: a retry under it is the first thing the daemon that is
    back hears (a Cancel of the lost one before it would have it refused, as a Cancel that
    overtook its Submit)."""
    endpoint = f"ipc://{tmp_path}/daemon"
    with anyio.fail_after(10):
        async with AsyncClient(endpoint) as client, anyio.create_task_group() as tg:
            daemon = router_at(ctx, endpoint)
            outcome: list[BaseException] = []

            async def submit() -> None:
                with pytest.raises(ConnectionError) as caught:
                    await client.submit(PARAMS, request_id="lost", timeout_s=60)
                outcome.append(caught.value)

            tg.start_soon(submit)
            _, _, body = await daemon.recv_multipart()
            assert CLIENT_REQUEST.decode(body).request_id == "lost"
            closed = time.monotonic()
            daemon.close(linger=0)
            while not outcome:
                await anyio.sleep(0.01)
            assert time.monotonic() - closed < 1.0
            assert "closed while the request waited" in str(outcome[0])
            daemon = router_at(ctx, endpoint)
            try:
                tg.start_soon(partial(client.submit, PARAMS, request_id="lost", timeout_s=60))
                identity, _, body = await daemon.recv_multipart()
                assert isinstance(CLIENT_REQUEST.decode(body), Submit)
                await daemon.send_multipart([identity, b"", encode(Result(request_id="lost", outputs=[], stages=[],
                                                                          total_ms=1.0))])
            finally:
                daemon.close(linger=0)


async def test_a_request_lost_with_its_connection_is_retried_under_its_id_at_the_daemon_back(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Against the daemon's real client socket, restarted: a Cancel of the lost request by
    the new connection would find nothing there and have the retry refused, as a Cancel
    that overtook its Submit (the frontend remembers those for a second)."""
    with anyio.fail_after(20):
        async with AsyncClient(f"ipc://{tmp_path}/clients") as client, anyio.create_task_group() as tg:

            failed = anyio.Event()

            async def lost() -> None:
                with pytest.raises(ConnectionError, match="closed while the request waited"):
                    await client.submit(PARAMS, request_id="X", timeout_s=30)
                failed.set()

            async with running_frontend(ctx, tmp_path) as daemon:
                tg.start_soon(lost)
                assert isinstance(await daemon.tracker.receive(), Admit)  # X runs there...
            await failed.wait()
            async with running_frontend(ctx, tmp_path) as back:  # ...until a restart
                tg.start_soon(partial(client.submit, PARAMS, request_id="X", timeout_s=30))
                admitted = await back.tracker.receive()
                assert isinstance(admitted, Admit) and admitted.request_id.startswith("X#")
                tg.cancel_scope.cancel()


async def test_closing_the_client_as_it_replaces_its_socket_closes_the_old_one_too(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """The client closes while the socket its connection's close made it replace is not yet
    closed: left open, it would keep the context's end (a thread) waiting for good."""
    endpoint = f"ipc://{tmp_path}/daemon"
    daemon = router_at(ctx, endpoint)
    with anyio.fail_after(10):
        async with AsyncClient(endpoint) as client:
            while not (client._watch and client._watch.connected):
                await anyio.sleep(0.01)
            old = client._sock
            daemon.close(linger=0)
            while client._generation == 0:
                await asyncio.sleep(0)  # returns as the replacement waits a turn for the old one
    assert old is not None and old.closed


def test_a_blocking_request_whose_connection_closes_fails_at_once(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/daemon"
    ctx = zmq.Context()
    daemon = router_at(ctx, endpoint)
    try:
        with Client(endpoint, ctx=ctx) as client:
            def close_on_submit() -> None:
                daemon.recv_multipart()
                daemon.close(linger=0)

            closer = threading.Thread(target=close_on_submit)
            closer.start()
            started = time.monotonic()
            with pytest.raises(ConnectionError, match="closed while the request waited"):
                client.submit(PARAMS, timeout_s=60)
            closer.join()
            assert time.monotonic() - started < 2.5  # at once, then up to 1 s trying to cancel
    finally:
        daemon.close(linger=0)
        ctx.term()


def answered(frames: list[bytes], total_ms: float) -> list[bytes]:
    """The fake daemon's Result for the Submit that came as ``frames``."""
    identity, _, body = frames
    return [identity, b"", encode(Result(request_id=CLIENT_REQUEST.decode(body).request_id, outputs=[], stages=[],
                                         total_ms=total_ms))]


async def answer_then_stop(daemon: zmq.asyncio.Socket) -> None:
    await daemon.send_multipart(answered(await daemon.recv_multipart(), 1.0))
    daemon.close(linger=1000)


def answer_then_stop_blocking(daemon: zmq.Socket) -> None:
    daemon.send_multipart(answered(daemon.recv_multipart(), 2.0))
    daemon.close(linger=1000)


async def test_an_answer_that_came_just_before_its_connection_closed_is_an_answer(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """A draining daemon answers, then stops at once: the answer stands for either client,
    whichever the client hears of first."""
    endpoint = f"ipc://{tmp_path}/daemon"
    for _ in range(5):
        async with AsyncClient(endpoint) as client, anyio.create_task_group() as tg:
            tg.start_soon(answer_then_stop, router_at(ctx, endpoint))
            with anyio.fail_after(5):
                assert (await client.submit(PARAMS, timeout_s=60)).result.total_ms == 1.0
        blocking_ctx = zmq.Context()
        answering = threading.Thread(target=answer_then_stop_blocking, args=(router_at(blocking_ctx, endpoint),))
        answering.start()
        try:
            with Client(endpoint, ctx=blocking_ctx) as blocking:
                assert blocking.submit(PARAMS, timeout_s=60).result.total_ms == 2.0
        finally:
            answering.join()
            blocking_ctx.term()


@pytest.mark.parametrize("make", [Client, AsyncClient, Control], ids=["Client", "AsyncClient", "Control"])
def test_a_client_refuses_an_endpoint_it_cannot_connect_to_saying_why(make: type) -> None:
    """``*`` is for the daemon to bind; ZMQ's own word for connecting to it is "Invalid argument"."""
    with pytest.raises(ValueError, match=r"tcp://\*:5555 is an address for the daemon to bind, not one to connect to"):
        make("tcp://*:5555")


def test_the_control_client_refuses_a_port_out_of_range_at_once() -> None:
    """Not after its whole timeout: no daemon can listen on port 99999."""
    with pytest.raises(ValueError, match=r"tcp://127.0.0.1:99999 is port 99999, not 1-65535"):
        Control("tcp://127.0.0.1:99999")
