"""The blocking Client against a fake daemon, played from a thread (where it must answer):
a Client shared by threads, cancelled from another thread, interrupted, timed out, or
pointed at a socket that is not the daemon's client socket."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from orchestrator.client import AsyncClient, Client, Rejection
from orchestrator.control_client import Control
from tests.actors.fake_daemon import WORKER_SOCKETS_REFUSAL, router_at
from transfer.protocol import (
    CLIENT_REQUEST,
    Cancel,
    Cancelled,
    GenParams,
    Progress,
    Reason,
    Rejected,
    Result,
    Workers,
    encode,
)

PARAMS = GenParams(prompt="watched")

BlockingDaemon = tuple[zmq.Context, zmq.Socket, str]


@pytest.fixture
def blocking_daemon(tmp_path: Path) -> Iterator[BlockingDaemon]:
    """A plain ROUTER where the daemon's client socket would be, on a context of its own, for
    the blocking clients (the test plays the daemon, from a thread where it must answer)."""
    ctx = zmq.Context()
    endpoint = f"ipc://{tmp_path}/daemon"
    daemon = router_at(ctx, endpoint)
    yield ctx, daemon, endpoint
    daemon.close(linger=0)
    ctx.term()


def test_a_blocking_cancel_may_wait_longer_than_zmq_polls_at_once(blocking_daemon: BlockingDaemon) -> None:
    """ZMQ's poll takes a C int of milliseconds: a wait of 1e12 s raised OverflowError
    after the Cancel had gone (an audit); it is polled in turns instead."""
    _, daemon, endpoint = blocking_daemon

    def answer() -> None:
        canceller, _, body = daemon.recv_multipart()
        time.sleep(0.2)  # the client polls meanwhile
        daemon.send_multipart([canceller, b"", encode(Cancelled(request_id=CLIENT_REQUEST.decode(body).request_id,
                                                                found=True))])

    answering = threading.Thread(target=answer, daemon=True)
    answering.start()
    with Client(endpoint) as client:  # not on the daemon's context, as below
        assert client.cancel("r", timeout_s=1e12) is True
    answering.join(5)


def test_a_blocking_submit_can_be_cancelled_from_another_thread(blocking_daemon: BlockingDaemon) -> None:
    """The Cancel goes by a connection of its own (the submit's REQ socket waits for its
    answer and can send nothing), carrying the submit's token; the daemon answers each on
    its own connection, and the submit raises the cancelled Rejection."""
    _, daemon, endpoint = blocking_daemon
    submitted = threading.Event()

    def cancelling_daemon() -> None:
        submitter, _, body = daemon.recv_multipart()
        submit = CLIENT_REQUEST.decode(body)
        submitted.set()
        assert daemon.poll(5000)
        canceller, _, body = daemon.recv_multipart()
        cancel = CLIENT_REQUEST.decode(body)
        assert isinstance(cancel, Cancel) and canceller != submitter
        assert (cancel.request_id, cancel.cancel_token) == (submit.request_id, submit.cancel_token)
        daemon.send_multipart([canceller, b"", encode(Cancelled(request_id=cancel.request_id, found=True))])
        daemon.send_multipart([submitter, b"", encode(Rejected(request_id=submit.request_id, reason=Reason.CANCELLED,
                                                               message="cancelled by the client"))])

    outcome: list[BaseException] = []

    def submit(client: Client) -> None:
        try:
            client.submit(PARAMS, request_id="long", timeout_s=30)
        except BaseException as exc:
            outcome.append(exc)

    playing = threading.Thread(target=cancelling_daemon, daemon=True)
    playing.start()
    # Not on the daemon's context, whose end would wait for good on sockets a broken client left open.
    with Client(endpoint) as client:
        waiting = threading.Thread(target=submit, args=(client,), daemon=True)
        waiting.start()
        assert submitted.wait(5)
        assert client.cancel("long", timeout_s=5) is True
        waiting.join(5)
    playing.join(5)
    [raised] = outcome
    assert isinstance(raised, Rejection) and raised.reason == Reason.CANCELLED


def test_a_blocking_client_shared_by_threads_serves_them_one_at_a_time(blocking_daemon: BlockingDaemon) -> None:
    """Each gets its own answer: a REQ socket takes one request at a time, and a second
    thread's send in between would break it (ZMQ errors, an answered request reported as a
    timeout)."""
    _, daemon, endpoint = blocking_daemon
    threads = 4

    def slow_daemon() -> None:  # never two requests at once: the client sends the next one on an answer
        for _ in range(threads):
            assert daemon.poll(5000)
            frames = daemon.recv_multipart()
            assert not daemon.poll(50)
            identity, _, body = frames
            rid = CLIENT_REQUEST.decode(body).request_id
            daemon.send_multipart([identity, b"", encode(Result(request_id=rid, outputs=[], stages=[],
                                                                total_ms=float(rid)))])

    playing = threading.Thread(target=slow_daemon, daemon=True)
    playing.start()
    answers: dict[str, object] = {}

    def submit(client: Client, rid: str) -> None:
        try:
            answers[rid] = client.submit(PARAMS, request_id=rid, timeout_s=10).result.total_ms
        except Exception as exc:
            answers[rid] = exc

    with Client(endpoint) as client:  # not on the daemon's context, as above
        users = [threading.Thread(target=submit, args=(client, str(i)), daemon=True) for i in range(threads)]
        for user in users:
            user.start()
        deadline = time.monotonic() + 10
        for user in users:
            user.join(max(deadline - time.monotonic(), 0))
    playing.join(5)
    assert answers == {str(i): float(i) for i in range(threads)}


def test_closing_a_blocking_client_waits_for_the_submit_another_thread_waits_on(
    blocking_daemon: BlockingDaemon
) -> None:
    """The submit gets its answer; closing the socket under its wait raised a ZMQError in
    the submitting thread (a ZMQ socket serves one thread at a time)."""
    _, daemon, endpoint = blocking_daemon
    submitted = threading.Event()

    def late_daemon() -> None:
        identity, _, body = daemon.recv_multipart()
        submitted.set()
        time.sleep(0.3)  # the close comes while the submit waits
        rid = CLIENT_REQUEST.decode(body).request_id
        daemon.send_multipart([identity, b"", encode(Result(request_id=rid, outputs=[], stages=[], total_ms=3.0))])

    outcome: list[object] = []

    def submit(client: Client) -> None:
        try:
            outcome.append(client.submit(PARAMS, request_id="r", timeout_s=10).result.total_ms)
        except BaseException as exc:
            outcome.append(exc)

    playing = threading.Thread(target=late_daemon, daemon=True)
    playing.start()
    client = Client(endpoint)  # not on the daemon's context, as above
    waiting = threading.Thread(target=submit, args=(client,), daemon=True)
    waiting.start()
    assert submitted.wait(5)
    client.close()
    waiting.join(5)
    playing.join(5)
    assert outcome == [3.0]
    # Closed, it says so; it raised a bare ZMQError and opened a new socket (a client audit).
    for call in (partial(client.submit, PARAMS), partial(client.cancel, "r")):
        with pytest.raises(RuntimeError, match="this Client was closed: make a new one"):
            call()
    assert client._sock.closed


def test_a_blocking_clients_timed_out_wait_cancels_its_request(blocking_daemon: BlockingDaemon, monkeypatch) -> None:
    """A daemon stalled past the client's patience reads the submit late, its deadline
    counting from then: the client's Cancel keeps it from working for nobody."""
    monkeypatch.setattr("orchestrator.client_wire.GRACE_S", 0.05)
    ctx, daemon, endpoint = blocking_daemon
    with Client(endpoint, ctx=ctx) as client:
        with pytest.raises(TimeoutError):
            client.submit(PARAMS, request_id="stalled", timeout_s=0.2)
        heard = []
        while daemon.poll(1000):
            heard.append(CLIENT_REQUEST.decode(daemon.recv_multipart()[2]))
    assert [(type(m).__name__, m.request_id) for m in heard] == [("Submit", "stalled"), ("Cancel", "stalled")]


def test_a_blocking_clients_cancel_refused_after_its_wait_ran_out_leaves_the_timeout(
    blocking_daemon: BlockingDaemon, monkeypatch
) -> None:
    """Its id is in flight for another client by the time its Cancel arrives (its own Submit
    was refused as a duplicate): an audit found the refusal's PermissionError raised in place
    of the TimeoutError the caller waited for."""
    monkeypatch.setattr("orchestrator.client_wire.GRACE_S", 0.05)
    ctx, daemon, endpoint = blocking_daemon

    def refuse_the_cancel() -> None:
        for _ in range(2):  # the Submit, left unanswered; then its Cancel
            identity, _, body = daemon.recv_multipart()
        rid = CLIENT_REQUEST.decode(body).request_id
        daemon.send_multipart([identity, b"", encode(Cancelled(request_id=rid, found=False, refused=True))])

    with Client(endpoint, ctx=ctx) as client:
        refuser = threading.Thread(target=refuse_the_cancel)
        refuser.start()
        with pytest.raises(TimeoutError):
            client.submit(PARAMS, request_id="taken", timeout_s=0.2)
        refuser.join(5)


def test_a_blocking_client_closed_as_its_submit_times_out_still_cancels_it(
    blocking_daemon: BlockingDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread's close(), waiting for the call in flight, can land between the submit's
    wait and its own Cancel: that Cancel raised "this Client was closed" in place of the
    TimeoutError, and never left (a client audit)."""
    monkeypatch.setattr("orchestrator.client_wire.GRACE_S", 0.05)
    ctx, daemon, endpoint = blocking_daemon
    request = Client._request

    def closed_meanwhile(client: Client, *args: Any) -> Any:
        try:
            return request(client, *args)
        finally:
            client.close()  # as the waiting close() takes the lock the moment the wait lets it go

    monkeypatch.setattr(Client, "_request", closed_meanwhile)
    with Client(endpoint, ctx=ctx) as client, pytest.raises(TimeoutError):
        client.submit(PARAMS, request_id="orphan", timeout_s=0.2)
    heard = []
    while daemon.poll(1000):
        heard.append(CLIENT_REQUEST.decode(daemon.recv_multipart()[2]))
    assert [(type(m).__name__, m.request_id) for m in heard] == [("Submit", "orphan"), ("Cancel", "orphan")]


@pytest.mark.parametrize("when", ["waiting", "sent"])
def test_a_blocking_clients_interrupted_wait_cancels_its_request_and_leaves_it_usable(
    blocking_daemon: BlockingDaemon, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """Ctrl-C while Client.submit waits, or just as its message left: the request is
    cancelled at the daemon, and the REQ socket, which had sent and not heard back, is
    replaced so the next call works."""
    ctx, daemon, endpoint = blocking_daemon
    heard: list[Any] = []

    def play_daemon() -> None:  # answers the Cancel, then the next Submit; never the first
        while not heard or heard[-1].request_id != "next":
            assert daemon.poll(10_000)
            identity, _, body = daemon.recv_multipart()
            heard.append(message := CLIENT_REQUEST.decode(body))
            if isinstance(message, Cancel):
                daemon.send_multipart([identity, b"", encode(Cancelled(request_id=message.request_id, found=True))])
            elif message.request_id == "next":
                daemon.send_multipart([identity, b"", encode(Result(request_id=message.request_id, outputs=[],
                                                                    stages=[], total_ms=1.0))])

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    thread = threading.Thread(target=play_daemon, daemon=True)
    thread.start()
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with Client(endpoint, ctx=ctx) as client:
            if when == "waiting":
                signal.setitimer(signal.ITIMER_REAL, 0.3)
            else:
                send = zmq.Socket.send_multipart

                def send_then_interrupt(sock: zmq.Socket, *args: Any, **kwargs: Any) -> None:
                    monkeypatch.setattr(zmq.Socket, "send_multipart", send)  # the first send only
                    send(sock, *args, **kwargs)
                    raise KeyboardInterrupt  # as pyzmq raises a signal's, after zmq_send returned

                monkeypatch.setattr(zmq.Socket, "send_multipart", send_then_interrupt)
            with pytest.raises(KeyboardInterrupt):
                client.submit(PARAMS, request_id="interrupted", timeout_s=30)
            assert client.submit(PARAMS, request_id="next", timeout_s=10).result.total_ms == 1.0
        thread.join(timeout=10)
        # The Cancel goes by the fresh socket. The old one, closed at once, may have sent its
        # Submit or not, and a ROUTER may read it after the Cancel (the daemon then refuses
        # it: actors/frontend.py, CANCEL_OVERTAKES_S).
        first = {(type(m).__name__, m.request_id) for m in heard[:-1]}
        assert ("Cancel", "interrupted") in first <= {("Cancel", "interrupted"), ("Submit", "interrupted")}
        assert (type(heard[-1]).__name__, heard[-1].request_id) == ("Submit", "next")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_an_answer_of_the_wrong_kind_is_a_clear_error_in_every_client(blocking_daemon: BlockingDaemon) -> None:
    """A peer that answers a request with another message (no Triptych daemon, or one with a
    bug): a ValueError naming what came, not an assertion (gone under ``python -O``)."""
    ctx, daemon, endpoint = blocking_daemon
    answers = [Progress(request_id="mine", state="encoding", elapsed_ms=0.0),
               Result(request_id="someone-else", outputs=[], stages=[], total_ms=1.0),
               Workers(instances=[])]

    def answer_wrongly() -> None:
        for answer in answers:
            if daemon.poll(5000):
                identity, _, _ = daemon.recv_multipart()
                daemon.send_multipart([identity, b"", encode(answer)])

    thread = threading.Thread(target=answer_wrongly, daemon=True)
    thread.start()
    with Client(endpoint, ctx=ctx) as client:
        with pytest.raises(ValueError, match=f"^{endpoint} answered with Progress where Generation was due"):
            client.submit(PARAMS, request_id="mine", timeout_s=5)
        with pytest.raises(ValueError, match="answered request 'mine' with the Result of 'someone-else'"):
            client.submit(PARAMS, request_id="mine", timeout_s=5)
    with pytest.raises(ValueError, match="answered with Workers where Stats was due"):
        Control(endpoint, ctx=ctx).stats()
    thread.join(timeout=10)


@pytest.mark.parametrize(("answer", "said", "control_said"), [
    (b"\x81\xa4kind\xafRegisterRefused", "its answer is unreadable", "its answer is no control reply"),
    (encode(WORKER_SOCKETS_REFUSAL), "this is the daemon's worker socket;", "this is the daemon's worker socket;"),
], ids=["garbage", "worker-socket"])
def test_the_blocking_clients_pointed_at_another_socket_say_so(blocking_daemon: BlockingDaemon, answer: bytes,
                                                               said: str, control_said: str) -> None:
    """An answer that is no client reply: a ValueError naming the endpoint and, where the
    daemon's worker socket answered, its refusal saying which socket it is (the same words
    from the client and the control client), not msgspec's words about a field."""
    ctx, daemon, endpoint = blocking_daemon

    def answer_everything_wrongly() -> None:
        while daemon.poll(2000):
            identity, _, _ = daemon.recv_multipart()
            daemon.send_multipart([identity, b"", answer])

    thread = threading.Thread(target=answer_everything_wrongly, daemon=True)
    thread.start()
    with Client(endpoint, ctx=ctx) as client:
        with pytest.raises(ValueError, match=f"^{endpoint} is not a Triptych client socket: {said}"):
            client.submit(PARAMS, timeout_s=5)
    with pytest.raises(ValueError, match=f"^{endpoint} is not a control socket: {control_said}"):
        Control(endpoint, ctx=ctx).stats()
    thread.join(timeout=10)


@pytest.mark.parametrize("endpoint", [None, b"tcp://127.0.0.1:5555", Path("/tmp/daemon")],
                         ids=["none", "bytes", "path"])
def test_an_endpoint_that_is_no_str_is_a_type_error_saying_so(endpoint: object) -> None:
    """An endpoint from a config that lacks it, or read as bytes: AttributeError and TypeError
    from inside the check ('NoneType' object has no attribute 'startswith'), in every client."""
    for client in (Client, AsyncClient, Control):
        with pytest.raises(TypeError, match=f"^endpoint must be a str such as 'tcp://host:5555', not "
                                            f"{type(endpoint).__name__}$"):
            client(endpoint)


def test_a_blocking_client_on_an_asyncio_context_says_to_use_the_async_client(tmp_path: Path) -> None:
    """Its sockets return futures: the first submit failed with "object of type
    '_asyncio.Future' has no len()", and pyzmq's warnings."""
    ctx = zmq.asyncio.Context()
    try:
        for client in (Client, Control):
            with pytest.raises(TypeError, match="a zmq.asyncio.Context serves asyncio code: use AsyncClient"):
                client(f"ipc://{tmp_path}/daemon", ctx=ctx)
    finally:
        ctx.destroy(linger=0)  # (whatever a client made on it)
