"""AsyncClient against a fake daemon: progress reaches the caller's task, and a caller that
stops listening (its on_progress raised) cancels the request at the daemon."""

from __future__ import annotations

import asyncio
import itertools
import math
import pickle
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path

import anyio
import numpy as np
import pytest
import zmq
import zmq.asyncio

import orchestrator.async_client
from orchestrator.async_client import PROGRESS_BACKLOG
from orchestrator.client import AsyncClient, Client, Generation, Rejection
from orchestrator.client_wire import CANCEL_SEND_S, DEFAULT_TIMEOUT_S, CancelTokens
from orchestrator.control_client import Control
from tests.actors.fake_daemon import CONTROL_SOCKETS_REFUSAL, WORKER_SOCKETS_REFUSAL, router_at
from tests.actors.progress_flood import FLOODING_AFTER, ProgressFlood
from tests.conftest import outcome_of
from transfer.protocol import (
    CLIENT_REQUEST,
    PROTOCOL_VERSION,
    Cancel,
    Cancelled,
    GenParams,
    Progress,
    Reason,
    Rejected,
    Result,
    Submit,
    TensorSpec,
    encode,
)

PARAMS = GenParams(prompt="watched")

FakeDaemon = tuple[zmq.asyncio.Socket, str]

# Ids no request can have, and what refuses each, unsent.
BAD_IDS = [(b"r", "^invalid: not sent: request_id must be a str, not bytes$"),
           ("", r"^invalid: not sent: Expected `str` of length >= 1 - at `\$.request_id`$"),
           ("a" * 129, r"^invalid: not sent: Expected `str` of length <= 128 - at `\$.request_id`$")]


@pytest.fixture
def fake_daemon(ctx: zmq.asyncio.Context, tmp_path: Path) -> Iterator[FakeDaemon]:
    """A ROUTER where the daemon's client socket would be, and its endpoint: the test plays
    the daemon."""
    endpoint = f"ipc://{tmp_path}/daemon"
    daemon = router_at(ctx, endpoint)
    yield daemon, endpoint
    daemon.close(linger=0)


async def senders(daemon: zmq.asyncio.Socket, count: int) -> dict[str, bytes]:
    """Take ``count`` requests at the fake daemon: each request id's connection identity."""
    identities = {}
    for _ in range(count):
        identity, _, body = await daemon.recv_multipart()
        identities[CLIENT_REQUEST.decode(body).request_id] = identity
    return identities


async def reply(daemon: zmq.asyncio.Socket, identity: bytes, message: object, *, settle_s: float = 0.0) -> None:
    """Send ``message`` from the fake daemon by the connection ``identity``; then give the
    client ``settle_s`` to read it."""
    await daemon.send_multipart([identity, b"", encode(message)])
    await anyio.sleep(settle_s)


async def answer_next(daemon: zmq.asyncio.Socket, total_ms: float) -> None:
    """Answer the next Submit at the fake daemon with an empty Result."""
    identity, _, body = await daemon.recv_multipart()
    await reply(daemon, identity, Result(request_id=CLIENT_REQUEST.decode(body).request_id, outputs=[], stages=[],
                                         total_ms=total_ms))


async def heard_at_least(heard: list, count: int) -> None:
    while len(heard) < count:
        await anyio.sleep(0.005)


async def test_progress_comes_before_the_result_and_a_raising_listener_cancels_the_request(
    fake_daemon: FakeDaemon
) -> None:
    daemon, endpoint = fake_daemon

    async def receive() -> tuple[bytes, object]:
        identity, empty, body = await daemon.recv_multipart()
        return identity, CLIENT_REQUEST.decode(body)

    def progress(rid: str, step: int) -> Progress:
        return Progress(request_id=rid, state="denoising", elapsed_ms=float(step), step=step, steps=4)

    with anyio.fail_after(10):
        async with AsyncClient(endpoint) as client, anyio.create_task_group() as tg:
            heard: list[Progress] = []

            async def answer_with_progress() -> None:
                identity, submit = await receive()
                assert isinstance(submit, Submit) and submit.progress and submit.request_id == "r1"
                for step in (1, 2):
                    await reply(daemon, identity, progress("r1", step))
                    await heard_at_least(heard, step)  # else the answer, once in, skips the rest
                await reply(daemon, identity, Result(request_id="r1", outputs=[], stages=[], total_ms=3.0))
                await reply(daemon, identity, progress("r1", 3))  # after the answer: nobody listens

            tg.start_soon(answer_with_progress)
            generation = await client.submit(PARAMS, request_id="r1", on_progress=heard.append)
            assert generation.result.total_ms == 3.0
            assert [p.step for p in heard] == [1, 2]

            def explode(news: Progress) -> None:
                raise ValueError(f"the caller's listener broke at step {news.step}")

            async def answer_then_expect_cancel() -> None:
                identity, submit = await receive()
                assert isinstance(submit, Submit) and submit.request_id == "r2"
                await reply(daemon, identity, progress("r2", 1))
                _, cancel = await receive()
                assert cancel == Cancel(protocol=submit.protocol, request_id="r2", cancel_token=submit.cancel_token)

            tg.start_soon(answer_then_expect_cancel)
            with pytest.raises(ValueError, match="broke at step 1"):
                await client.submit(PARAMS, request_id="r2", on_progress=explode)


async def test_a_submit_the_daemon_would_refuse_is_refused_at_once_and_never_sent(fake_daemon: FakeDaemon) -> None:
    """A prompt of megabytes would be cut off unread at the daemon's size limit and get no
    answer at all: both clients check a Submit as the daemon will, before sending it."""
    daemon, endpoint = fake_daemon
    huge = GenParams(prompt="x" * (5 << 20))
    with anyio.fail_after(5):
        async with AsyncClient(endpoint) as client:
            with pytest.raises(Rejection) as refused:
                await client.submit(huge, timeout_s=30)
        with Client(endpoint) as blocking, pytest.raises(Rejection) as refused_too:
            blocking.submit(GenParams(prompt="p", steps=0), timeout_s=30)
        async with AsyncClient(endpoint) as client:  # 0 is a bad deadline, not "none given"
            with pytest.raises(Rejection, match=r"not sent: Expected `float` > 0.0 - at `\$.timeout_s`"):
                await client.submit(GenParams(prompt="p"), timeout_s=0)
            with pytest.raises(Rejection, match=r"not sent: can't serialize ints"):  # past msgpack's 64 bits
                await client.submit(GenParams(prompt="p", seed=2**70), timeout_s=30)
            with pytest.raises(Rejection, match="not sent: Encoding objects of type numpy.int64 is unsupported"):
                await client.submit(GenParams(prompt="p", seed=np.int64(7)), timeout_s=30)
            with pytest.raises(Rejection, match="not sent: 'utf-8' codec can't encode"):  # a lone surrogate
                await client.submit(GenParams(prompt="a\ud800b"), timeout_s=30)
            with pytest.raises(Rejection, match="not sent: request_id must be a str, not int"):
                await client.submit(GenParams(prompt="p"), request_id=7, timeout_s=30)
            for deaf in (5, "print"):  # refused before the request runs, not as its first Progress comes
                with pytest.raises(TypeError, match="on_progress must be a function or a coroutine function, not"):
                    await client.submit(GenParams(prompt="p"), timeout_s=30, on_progress=deaf)
            # A Cancel the daemon would refuse is refused here as a Submit is, not after a round
            # trip as a Rejection with a wire field's path, or with no daemon a ConnectionError.
            for rid, said in BAD_IDS:
                with pytest.raises(Rejection, match=said) as refused_cancel:
                    await client.cancel(rid)
                assert refused_cancel.value.reason == Reason.INVALID
            with pytest.raises(TypeError, match="timeout_s must be a number of seconds, not str"):
                await client.cancel("r", timeout_s="1")
            for never_ending in (-1.0, math.inf, 0.0):
                with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
                    await client.cancel("r", timeout_s=never_ending)
        with Client(endpoint) as blocking, pytest.raises(Rejection, match="not sent: request_id must be a str"):
            blocking.submit(GenParams(prompt="p"), request_id=7, timeout_s=30)
        for never_ending in (-1.0, math.inf, math.nan):
            with Client(endpoint) as blocking, pytest.raises(ValueError, match="positive number of seconds"):
                blocking.cancel("r", timeout_s=never_ending)
        with Client(endpoint) as blocking:
            for rid, said in BAD_IDS:
                with pytest.raises(Rejection, match=said):
                    blocking.cancel(rid)
            with pytest.raises(TypeError, match="timeout_s must be a number of seconds, not str"):
                blocking.cancel("r", timeout_s="1")
            with pytest.raises(ValueError, match="positive number of seconds"):
                Control(endpoint, timeout_s=never_ending)
    assert refused.value.reason == Reason.INVALID and "$.params.prompt" in refused.value.rejected.message
    assert refused_too.value.reason == Reason.INVALID and "$.params.steps" in refused_too.value.rejected.message
    assert refused.value.rejected.message.startswith("not sent")
    assert await daemon.poll(100) == 0


async def test_a_result_whose_frames_are_not_its_tensors_fails_its_own_request_only(fake_daemon: FakeDaemon) -> None:
    """It is a Rejected for that request; the request beside it carries on."""
    daemon, endpoint = fake_daemon
    image = TensorSpec(name="image", dtype="uint8", shape=(2, 2), nbytes=4)
    with anyio.fail_after(10):
        async with AsyncClient(endpoint) as client, anyio.create_task_group() as tg:

            async def answer_both() -> None:
                submits = await senders(daemon, 2)
                await daemon.send_multipart([submits["bad"], b"", encode(Result(
                    request_id="bad", outputs=[image], stages=[], total_ms=1.0)), b"abc"])
                await daemon.send_multipart([submits["good"], b"", encode(Result(
                    request_id="good", outputs=[image], stages=[], total_ms=1.0)), b"abcd"])

            tg.start_soon(answer_both)
            outcomes: dict[str, object] = {}

            async def submit(rid: str) -> None:
                outcomes[rid] = await outcome_of(client.submit(PARAMS, request_id=rid, timeout_s=5))

            tg.start_soon(submit, "bad")
            tg.start_soon(submit, "good")
    bad, good = outcomes["bad"], outcomes["good"]
    assert isinstance(bad, Rejected) and bad.reason == Reason.INVALID
    assert "frame has 3 bytes, header needs 4" in bad.message
    assert isinstance(good, Generation) and good.outputs["image"].flatten().tolist() == list(b"abcd")


@pytest.mark.parametrize(("answer", "raised", "said"), [
    ([b"", b"\xc1 not a reply"], ValueError, "is not a Triptych client socket: its answer is unreadable"),
    ([encode(Result(request_id="a", outputs=[], stages=[], total_ms=1.0))], ValueError,
     "its answer is unreadable \\(a reply without the empty delimiter frame first\\)"),
    ([b"", encode(WORKER_SOCKETS_REFUSAL)], ValueError,
     "is not a Triptych client socket: this is the daemon's worker socket;"),
    ([b"", encode(CONTROL_SOCKETS_REFUSAL)], Rejection, "invalid: this is the daemon's control socket;"),
], ids=["garbage", "no-delimiter", "worker-socket", "control-socket"])
async def test_an_answer_that_names_no_request_fails_every_request_on_the_connection_at_once(
    fake_daemon: FakeDaemon, answer: list[bytes], raised: type[Exception], said: str
) -> None:
    """The daemon's control or worker socket answers each request so: none can ever get its
    answer, and each fails with the blocking client's error, not after its whole deadline
    (125 s by default). The client serves on."""
    daemon, endpoint = fake_daemon
    failed: list[BaseException] = []
    with anyio.fail_after(5):
        async with AsyncClient(endpoint) as client:

            async def submit(rid: str) -> None:
                with pytest.raises(raised, match=said) as caught:
                    await client.submit(PARAMS, request_id=rid, timeout_s=60)
                failed.append(caught.value)

            async with anyio.create_task_group() as tg:
                tg.start_soon(submit, "a")
                tg.start_soon(submit, "b")
                identities = await senders(daemon, 2)
                await daemon.send_multipart([identities["a"], *answer])
            assert len(failed) == 2
            async with anyio.create_task_group() as tg:
                tg.start_soon(answer_next, daemon, 7.0)
                assert (await client.submit(PARAMS, request_id="c", timeout_s=60)).result.total_ms == 7.0


async def test_a_request_id_is_not_reused_on_a_client_until_its_request_ended(fake_daemon: FakeDaemon) -> None:
    """Answers are matched by id: a second request under a live id, or one given up on but
    not yet answered, would take the other's answers."""
    daemon, endpoint = fake_daemon
    with anyio.fail_after(10):
        async with AsyncClient(endpoint) as client, anyio.create_task_group() as tg:
            tg.start_soon(partial(client.submit, PARAMS, request_id="job-1"))
            identity, _, body = await daemon.recv_multipart()
            submit = CLIENT_REQUEST.decode(body)
            assert isinstance(submit, Submit) and submit.timeout_s == DEFAULT_TIMEOUT_S  # the client's own
            with pytest.raises(ValueError, match="in use"):
                await client.submit(PARAMS, request_id="job-1")
            tg.cancel_scope.cancel()  # the caller gives up: the request is cancelled at the daemon
        cancel = CLIENT_REQUEST.decode((await daemon.recv_multipart())[2])
        assert cancel == Cancel(protocol=submit.protocol, request_id="job-1", cancel_token=submit.cancel_token)
        assert len(submit.cancel_token) == 32
        async with AsyncClient(endpoint) as client:
            with anyio.move_on_after(0.1):
                await client.submit(PARAMS, request_id="job-2")  # given up on
            identity, _, _ = await daemon.recv_multipart()
            assert isinstance(CLIENT_REQUEST.decode((await daemon.recv_multipart())[2]), Cancel)
            with pytest.raises(ValueError, match="given up"):
                await client.submit(PARAMS, request_id="job-2")
            # Its answers come: the ack and the end; neither reaches anyone, and the id is free.
            await daemon.send_multipart([identity, b"", encode(Cancelled(request_id="job-2", found=True))])
            await daemon.send_multipart([identity, b"", encode(Rejected(
                request_id="job-2", reason=Reason.CANCELLED, message="cancelled by the client"))])
            await anyio.sleep(0.1)
            async with anyio.create_task_group() as tg:
                tg.start_soon(answer_next, daemon, 1.0)
                assert (await client.submit(PARAMS, request_id="job-2")).result.total_ms == 1.0


async def test_an_id_whose_end_came_is_free_even_if_its_listener_then_raised(fake_daemon: FakeDaemon) -> None:
    """The Result arrives while on_progress still runs, and then it raises: the request has
    ended at the daemon, so no Cancel goes out (it matches by id only, and could cancel a
    request submitted there under that id since), and the id is free at once."""
    daemon, endpoint = fake_daemon

    async def slow_then_fail(news: Progress) -> None:
        await anyio.sleep(0.3)  # the Result comes meanwhile
        raise ValueError("the web client went away")

    async def answer(*, with_progress: bool) -> None:
        identity, _, body = await daemon.recv_multipart()
        rid = CLIENT_REQUEST.decode(body).request_id
        if with_progress:
            await daemon.send_multipart([identity, b"", encode(Progress(
                request_id=rid, state="denoising", elapsed_ms=1.0, step=1, steps=2))])
        await daemon.send_multipart([identity, b"", encode(Result(request_id=rid, outputs=[], stages=[],
                                                                  total_ms=2.0))])

    with anyio.fail_after(10):
        async with AsyncClient(endpoint) as client:
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(answer, with_progress=True))
                with pytest.raises(ValueError, match="went away"):
                    await client.submit(PARAMS, request_id="job", on_progress=slow_then_fail)
            assert not await daemon.poll(300), CLIENT_REQUEST.decode((await daemon.recv_multipart())[2])
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(answer, with_progress=False))
                assert (await client.submit(PARAMS, request_id="job", timeout_s=5)).result.total_ms == 2.0


async def close_under_a_waiting_submit(endpoint: str, submitted: Callable[[], Awaitable[object]]) -> float:
    """Open a client at ``endpoint``, submit "orphan" from another task, close the client once
    ``submitted()`` returns; the submit must raise ConnectionError. How long closing took."""
    errors: list[BaseException] = []
    async with anyio.create_task_group() as tg:
        client = AsyncClient(endpoint)
        await client.__aenter__()

        async def wait() -> None:
            with pytest.raises(ConnectionError, match="was closed") as closed:
                await client.submit(PARAMS, request_id="orphan", timeout_s=60)
            errors.append(closed.value)

        tg.start_soon(wait)
        await submitted()
        began = time.monotonic()
        await client.__aexit__(None, None, None)
        closed_in_s = time.monotonic() - began
    assert len(errors) == 1
    return closed_in_s


async def test_closing_the_client_ends_the_waits_of_its_submits_at_once(tmp_path: Path) -> None:
    with anyio.fail_after(5):  # no daemon: nothing ever answers
        closed_in_s = await close_under_a_waiting_submit(f"ipc://{tmp_path}/nobody", partial(anyio.sleep, 0.1))
    # Its Cancel, which has nowhere to go, lingers on a thread of its own, not on this loop.
    assert closed_in_s < CANCEL_SEND_S / 2


async def test_closing_the_client_cancels_its_waiting_requests_at_the_daemon(fake_daemon: FakeDaemon) -> None:
    """Their answers would reach nobody: the daemon should not work on for them."""
    daemon, endpoint = fake_daemon
    submits = []

    async def submitted() -> None:
        submits.append(CLIENT_REQUEST.decode((await daemon.recv_multipart())[2]))

    with anyio.fail_after(5):
        await close_under_a_waiting_submit(endpoint, submitted)
        _, _, cancel = await daemon.recv_multipart()
    [submit] = submits
    assert CLIENT_REQUEST.decode(cancel) == Cancel(protocol=PROTOCOL_VERSION, request_id="orphan",
                                                   cancel_token=submit.cancel_token)


async def test_a_client_whose_owner_task_is_cancelled_still_closes(fake_daemon: FakeDaemon) -> None:
    """Ctrl-C under asyncio.run, or a failing sibling, cancels the task inside ``async with``:
    the cancellation surfaced in the middle of the close, which it cut short. Waiting submits
    hung to their deadlines, their requests ran on at the daemon and the sockets leaked (a
    client audit). Now they end at once, cancelled at the daemon, and the sockets close."""
    daemon, endpoint = fake_daemon
    opened = anyio.Event()
    clients: list[AsyncClient] = []

    async def owner() -> None:
        async with AsyncClient(endpoint) as client:
            clients.append(client)
            opened.set()
            await anyio.sleep_forever()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            task = asyncio.get_running_loop().create_task(owner())
            await opened.wait()

            async def wait() -> None:
                with pytest.raises(ConnectionError, match="was closed"):
                    await clients[0].submit(PARAMS, request_id="orphan", timeout_s=60)

            tg.start_soon(wait)
            _, _, body = await daemon.recv_multipart()
            assert CLIENT_REQUEST.decode(body).request_id == "orphan"
            task.cancel()  # once, as asyncio.run does on Ctrl-C
            with pytest.raises(asyncio.CancelledError):
                await task
        _, _, cancel = await daemon.recv_multipart()
    assert isinstance(CLIENT_REQUEST.decode(cancel), Cancel) and CLIENT_REQUEST.decode(cancel).request_id == "orphan"
    assert clients[0]._sock is None


# A client opened and never closed, its loop ended: the collector reaps it with its context
# and sockets, in an order of its own choosing (gc.collect() here, any collection in a server).
NEVER_CLOSED = """
import asyncio, gc, os, sys, time
from orchestrator.client import AsyncClient

async def forget():
    client = AsyncClient(sys.argv[1])
    await client.__aenter__()
    await asyncio.sleep(0.05)

gc.disable()
before = len(os.listdir("/proc/self/fd"))
for _ in range(3):
    asyncio.run(forget())
gc.collect()
for _ in range(100):
    if len(os.listdir("/proc/self/fd")) == before:
        break
    time.sleep(0.05)
print(len(os.listdir("/proc/self/fd")) - before)
"""


def test_a_client_never_closed_is_collected_without_freezing_the_process(tmp_path: Path) -> None:
    """pyzmq's context finalizer found no socket left to close and waited in term() for ever
    for those not collected yet: a collection froze the process (a client audit). Now it
    ends, and every descriptor the clients held comes back."""
    done = subprocess.run([sys.executable, "-W", "ignore::ResourceWarning", "-c", NEVER_CLOSED,
                           f"ipc://{tmp_path}/nobody"], capture_output=True, text=True, timeout=30,
                          cwd=Path(__file__).parents[2])
    assert (done.returncode, done.stdout.strip()) == (0, "0"), done.stderr


async def test_closing_the_client_under_a_waiting_cancel_raises_connection_error(fake_daemon: FakeDaemon) -> None:
    """Not CancelledError: the caller's task was not cancelled, and would take it for that."""
    daemon, endpoint = fake_daemon
    errors: list[BaseException] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            client = AsyncClient(endpoint)
            await client.__aenter__()

            async def cancel() -> None:
                with pytest.raises(ConnectionError, match="closed while cancelling 'r1'") as closed:
                    await client.cancel("r1", timeout_s=60)
                errors.append(closed.value)

            tg.start_soon(cancel)
            await daemon.recv_multipart()  # the Cancel arrived; the daemon never answers
            await client.__aexit__(None, None, None)
    assert len(errors) == 1


async def test_an_async_client_serves_only_the_event_loop_that_opened_it(tmp_path: Path) -> None:
    """Its reader runs on that loop: a submit from another thread's loop would wait out its
    deadline for an answer that had come, and then blame the daemon."""
    async with AsyncClient(f"ipc://{tmp_path}/daemon") as client:
        def from_another_thread() -> Generation:
            return asyncio.run(client.submit(PARAMS, timeout_s=5))

        with anyio.fail_after(5), pytest.raises(RuntimeError, match="event loop .thread. that opened it"):
            await anyio.to_thread.run_sync(from_another_thread)


async def test_a_cancel_the_daemon_does_not_answer_times_out_naming_what_it_waited_for(
    fake_daemon: FakeDaemon
) -> None:
    """The endpoint, the request and the wait, in both clients: not an empty TimeoutError."""
    daemon, endpoint = fake_daemon
    said = f"^no reply from {endpoint} to the Cancel of 'r7' within 0.3s$"
    with anyio.fail_after(5):
        async with AsyncClient(endpoint) as client:
            with pytest.raises(TimeoutError, match=said):
                await client.cancel("r7", timeout_s=0.3)
        with Client(endpoint) as blocking, pytest.raises(TimeoutError, match=said):
            blocking.cancel("r7", timeout_s=0.3)


async def test_an_async_client_used_outside_its_context_says_so() -> None:
    unopened = AsyncClient("ipc:///nonexistent/daemon")
    with pytest.raises(RuntimeError, match="inside `async with"):
        await unopened.submit(PARAMS)
    too_long = "ipc:///tmp/" + "x" * 200  # past a Unix socket path's length
    with pytest.raises(ValueError, match="is an ipc path of 205 bytes, past the 107"):
        AsyncClient(too_long)
    malformed = AsyncClient("ipc:///nonexistent/daemon")
    malformed.endpoint = too_long  # past the constructor's check: its connect fails
    with pytest.raises(zmq.ZMQError, match="File name too long"):
        await malformed.__aenter__()
    with pytest.raises(RuntimeError, match="opened before"):  # what it opened was closed on the failure
        await malformed.__aenter__()
    await unopened.__aexit__(None, None, None)  # nothing to close: no bare AssertionError
    async with AsyncClient("ipc:///nonexistent/daemon") as closed:
        pass
    # Not "use it inside `async with`", which it was (a client audit).
    for call in (partial(closed.submit, PARAMS), partial(closed.cancel, "r")):
        with pytest.raises(RuntimeError, match="^this AsyncClient was closed: make a new one$"):
            await call()
    await closed.__aexit__(None, None, None)  # closed again: nothing more to do, as Client.close


def test_an_async_client_outside_asyncio_says_it_needs_asyncio() -> None:
    """Under trio (anyio's other backend) it failed with "no running event loop". Its
    __aenter__ is stepped here without any loop, as trio runs it."""
    opening = AsyncClient("ipc:///nonexistent/daemon").__aenter__()
    with pytest.raises(RuntimeError, match="AsyncClient runs on asyncio .*run the asyncio backend"):
        opening.send(None)


def test_a_rejection_survives_pickling() -> None:
    """Job queues and process pools pickle the exceptions their tasks raise."""
    rejection = Rejection(Rejected(request_id="r", reason=Reason.OVERLOADED, message="busy"))
    copy = pickle.loads(pickle.dumps(rejection))
    assert (copy.reason, copy.rejected, str(copy)) == (Reason.OVERLOADED, rejection.rejected, str(rejection))


async def test_an_async_progress_listener_is_awaited(fake_daemon: FakeDaemon) -> None:
    """A web handler streams progress with awaits: a coroutine function is awaited, in order."""
    daemon, endpoint = fake_daemon
    streamed: list[int] = []

    async def stream(progress: Progress) -> None:
        await anyio.sleep(0.01)  # a write to the web client
        streamed.append(progress.step)

    async def answer() -> None:
        identity, _, body = await daemon.recv_multipart()
        rid = CLIENT_REQUEST.decode(body).request_id
        for step in (1, 2):
            await daemon.send_multipart([identity, b"", encode(Progress(
                request_id=rid, state="denoising", elapsed_ms=float(step), step=step, steps=2))])
            await heard_at_least(streamed, step)
        await daemon.send_multipart([identity, b"", encode(Result(request_id=rid, outputs=[], stages=[],
                                                                  total_ms=3.0))])

    with anyio.fail_after(10):
        async with AsyncClient(endpoint) as client, anyio.create_task_group() as tg:
            tg.start_soon(answer)
            generation = await client.submit(PARAMS, on_progress=stream)
    assert streamed == [1, 2] and generation.result.total_ms == 3.0


async def test_a_slow_progress_listener_never_costs_the_answer(
    fake_daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It hears progress in order until the answer is in, then no more: the answer waits for
    the call under way only; and a deadline that runs out in that call returns the answer,
    not a TimeoutError."""
    monkeypatch.setattr("orchestrator.client_wire.GRACE_S", 0.0)
    daemon, endpoint = fake_daemon

    async def run(*, busy_s: float, timeout_s: float) -> list[int]:
        """Progress 1; once the listener hears it, progress 2-8 and the answer at once."""
        heard: list[int] = []
        first = anyio.Event()

        async def slow(progress: Progress) -> None:
            heard.append(progress.step)
            first.set()
            await anyio.sleep(busy_s)

        async def answer() -> None:
            identity, _, body = await daemon.recv_multipart()
            rid = CLIENT_REQUEST.decode(body).request_id
            steps = [Progress(request_id=rid, state="denoising", elapsed_ms=float(step), step=step, steps=9)
                     for step in range(1, 9)]
            await daemon.send_multipart([identity, b"", encode(steps[0])])
            await first.wait()
            for message in [*steps[1:], Result(request_id=rid, outputs=[], stages=[], total_ms=3.0)]:
                await daemon.send_multipart([identity, b"", encode(message)])

        async with AsyncClient(endpoint) as client, anyio.create_task_group() as tg:
            tg.start_soon(answer)
            generation = await client.submit(PARAMS, timeout_s=timeout_s, on_progress=slow)
        assert generation.result.total_ms == 3.0
        return heard

    with anyio.fail_after(10):
        started = time.monotonic()
        # Busy with the first, the rest and the answer came meanwhile: returned, heard no more.
        assert await run(busy_s=0.5, timeout_s=5.0) == [1]
        assert time.monotonic() - started < 1.0  # one call of the listener, not eight
        # The deadline ran out in that call, after the answer came: the answer stands.
        assert await run(busy_s=0.6, timeout_s=0.3) == [1]


async def test_progress_past_the_backlog_of_a_busy_listener_is_dropped_and_the_answer_comes(
    fake_daemon: FakeDaemon
) -> None:
    """More Progress than PROGRESS_BACKLOG waiting for a listener still busy: the excess is
    dropped. Queued regardless, the one past the backlog raised WouldBlock in the client's
    reader, which ended the client and every request in flight on it."""
    daemon, endpoint = fake_daemon
    heard: list[int] = []
    first = anyio.Event()

    async def busy(progress: Progress) -> None:
        heard.append(progress.step)
        first.set()
        await anyio.sleep(0.3)

    async def answer() -> None:
        identity, _, body = await daemon.recv_multipart()
        rid = CLIENT_REQUEST.decode(body).request_id
        steps = [Progress(request_id=rid, state="denoising", elapsed_ms=float(step), step=step, steps=100)
                 for step in range(4 * PROGRESS_BACKLOG)]
        await daemon.send_multipart([identity, b"", encode(steps[0])])
        await first.wait()
        for message in [*steps[1:], Result(request_id=rid, outputs=[], stages=[], total_ms=3.0)]:
            await daemon.send_multipart([identity, b"", encode(message)])

    with anyio.fail_after(10):
        async with AsyncClient(endpoint) as client, anyio.create_task_group() as tg:
            tg.start_soon(answer)
            generation = await client.submit(PARAMS, timeout_s=5, on_progress=busy)
    assert generation.result.total_ms == 3.0
    assert heard == [0]  # busy with the first until the answer was in: heard no more


async def test_an_id_given_up_on_is_free_once_its_cancel_finds_nothing(fake_daemon: FakeDaemon) -> None:
    """Its end may never come (the daemon dropped it: its outbox full), but a Cancel the
    daemon read after the Submit and found nothing of says none will: the id is free then,
    not only once the request's wait has passed once more."""
    daemon, endpoint = fake_daemon
    with anyio.fail_after(10):
        async with AsyncClient(endpoint) as client:
            with pytest.raises(TimeoutError):
                await client.submit(PARAMS, request_id="job", timeout_s=0.1)  # its end never comes
            identity, _, body = await daemon.recv_multipart()
            assert isinstance(CLIENT_REQUEST.decode(body), Submit)
            assert isinstance(CLIENT_REQUEST.decode((await daemon.recv_multipart())[2]), Cancel)
            with pytest.raises(ValueError, match="in use"):
                await client.submit(PARAMS, request_id="job", timeout_s=5)
            await daemon.send_multipart([identity, b"", encode(Cancelled(request_id="job", found=False))])
            await anyio.sleep(0.1)
            async with anyio.create_task_group() as tg:
                tg.start_soon(answer_next, daemon, 2.0)
                assert (await client.submit(PARAMS, request_id="job", timeout_s=5)).result.total_ms == 2.0


async def test_only_the_latest_cancel_of_an_id_finding_nothing_frees_it(fake_daemon: FakeDaemon) -> None:
    """An id given up on twice: the first Cancel's ack (found nothing: its request had just
    ended) comes after the second request was given up on too, whose end may still come."""
    daemon, endpoint = fake_daemon

    async def given_up_on() -> bytes:
        with anyio.move_on_after(0.1):
            await client.submit(PARAMS, request_id="X", timeout_s=30)
        identity, _, submit = await daemon.recv_multipart()
        _, _, cancel = await daemon.recv_multipart()
        assert (type(CLIENT_REQUEST.decode(submit)), type(CLIENT_REQUEST.decode(cancel))) == (Submit, Cancel)
        return identity

    with anyio.fail_after(10):
        async with AsyncClient(endpoint) as client:
            identity = await given_up_on()
            say = partial(reply, daemon, identity, settle_s=0.05)  # and let the client read it
            await say(Result(request_id="X", outputs=[], stages=[], total_ms=1.0))  # its end: X is free
            await given_up_on()
            await say(Cancelled(request_id="X", found=False))  # the first Cancel's ack
            with pytest.raises(ValueError, match="in use"):
                await client.submit(PARAMS, request_id="X", timeout_s=30)
            await say(Cancelled(request_id="X", found=True))  # the second's
            await say(Rejected(request_id="X", reason=Reason.CANCELLED, message="cancelled by the client"))
            async with anyio.create_task_group() as tg:
                tg.start_soon(answer_next, daemon, 3.0)
                assert (await client.submit(PARAMS, request_id="X", timeout_s=5)).result.total_ms == 3.0


async def test_an_id_given_up_on_just_after_opening_is_held_for_its_wait_only(
    fake_daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sent before the client heard the daemon take its connection, but given up on after:
    its Submit left, so its hold is its wait once more, not until another daemon comes."""
    monkeypatch.setattr("orchestrator.client_wire.GRACE_S", 0.05)
    daemon, endpoint = fake_daemon
    with anyio.fail_after(10):
        async with AsyncClient(endpoint) as client:
            with pytest.raises(TimeoutError):
                await client.submit(PARAMS, request_id="X", timeout_s=0.2)  # never answered
            for kind in (Submit, Cancel):
                assert isinstance(CLIENT_REQUEST.decode((await daemon.recv_multipart())[2]), kind)
            await anyio.sleep(0.4)  # past its wait once more
            async with anyio.create_task_group() as tg:
                tg.start_soon(answer_next, daemon, 2.0)
                assert (await client.submit(PARAMS, request_id="X", timeout_s=5)).result.total_ms == 2.0


async def test_a_cancel_that_never_left_is_not_counted_among_those_to_answer(
    fake_daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(It waited behind a full queue past its second.) Counted, it would make the found=False
    of the id's next Cancel look like an earlier one's, and hold the id for its wait."""
    daemon, endpoint = fake_daemon
    leave = orchestrator.async_client._cancel_at_daemon

    async def first_never_leaves(sock: zmq.asyncio.Socket, request_ids: list[str], tokens: CancelTokens) -> int:
        first_never_leaves.calls += 1
        return 0 if first_never_leaves.calls == 1 else await leave(sock, request_ids, tokens)

    first_never_leaves.calls = 0
    monkeypatch.setattr("orchestrator.async_client._cancel_at_daemon", first_never_leaves)

    async def given_up_on() -> bytes:
        with anyio.move_on_after(0.1):
            await client.submit(PARAMS, request_id="X", timeout_s=30)
        identity, _, _ = await daemon.recv_multipart()
        return identity

    with anyio.fail_after(10):
        async with AsyncClient(endpoint) as client:
            identity = await given_up_on()  # its Cancel never leaves
            await daemon.send_multipart([identity, b"", encode(Result(request_id="X", outputs=[], stages=[],
                                                                      total_ms=1.0))])
            await anyio.sleep(0.05)  # its end frees the id
            await given_up_on()
            assert isinstance(CLIENT_REQUEST.decode((await daemon.recv_multipart())[2]), Cancel)
            await daemon.send_multipart([identity, b"", encode(Cancelled(request_id="X", found=False))])
            await anyio.sleep(0.05)
            async with anyio.create_task_group() as tg:
                tg.start_soon(answer_next, daemon, 3.0)
                assert (await client.submit(PARAMS, request_id="X", timeout_s=5)).result.total_ms == 3.0


async def test_an_id_is_in_use_until_its_submit_returns_even_once_answered(fake_daemon: FakeDaemon) -> None:
    """The answer is in while the request's on_progress still runs: a second request under
    the id then would take that answer, and the first fail as if the client had closed."""
    daemon, endpoint = fake_daemon
    with anyio.fail_after(10):
        async with AsyncClient(endpoint) as client, anyio.create_task_group() as tg:
            got: list[float] = []

            async def first() -> None:
                generation = await client.submit(PARAMS, request_id="same", on_progress=lambda _: anyio.sleep(0.5))
                got.append(generation.result.total_ms)

            tg.start_soon(first)
            identity, _, _ = await daemon.recv_multipart()
            await daemon.send_multipart([identity, b"", encode(Progress(request_id="same", state="encoding",
                                                                        elapsed_ms=0.0))])
            await anyio.sleep(0.1)  # its listener runs
            await daemon.send_multipart([identity, b"", encode(Result(request_id="same", outputs=[], stages=[],
                                                                      total_ms=1.0))])
            await anyio.sleep(0.1)  # the answer is in; the listener still runs
            with pytest.raises(ValueError, match="in use"):
                await client.submit(PARAMS, request_id="same")
        assert got == [1.0]


async def test_a_steady_stream_of_replies_never_holds_the_loop(tmp_path: Path) -> None:
    """pyzmq hands over a message already queued without suspending: a reader that took each
    as it came held the event loop for as long as the replies kept coming, and every other
    task on it (the submits waiting on them, the caller's own) stood still that long."""
    endpoint = f"ipc://{tmp_path}/daemon"
    ticks: list[float] = []

    async def tick() -> None:
        while True:
            ticks.append(time.monotonic())
            await anyio.sleep(0.005)

    with anyio.fail_after(20), ProgressFlood(endpoint, for_s=2.0) as flood:
        async with AsyncClient(endpoint) as client, anyio.create_task_group() as tg:
            tg.start_soon(tick)
            tg.start_soon(partial(client.submit, PARAMS, request_id="r", on_progress=lambda _: None))
            while not flood.ended.is_set():
                await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
    assert flood.sent > FLOODING_AFTER  # a stream with no pause, two seconds long
    assert max(later - earlier for earlier, later in itertools.pairwise(ticks)) < 0.5


async def test_progress_for_a_request_given_up_on_while_its_cancel_waits_harms_nobody(
    fake_daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listener of one request raises, and its Cancel waits to leave (ZMQ's queue for the
    daemon full): more progress for it meanwhile is dropped, and the other requests carry on."""
    from orchestrator import async_client as client_module

    cancel = client_module._cancel_at_daemon

    async def slow_cancel(sock: zmq.asyncio.Socket, request_ids: list[str], tokens: CancelTokens) -> None:
        await anyio.sleep(0.3)  # as a send behind a full queue
        await cancel(sock, request_ids, tokens)

    monkeypatch.setattr(client_module, "_cancel_at_daemon", slow_cancel)
    daemon, endpoint = fake_daemon

    def progress(step: int) -> Progress:
        return Progress(request_id="dropped", state="denoising", elapsed_ms=1.0, step=step, steps=4)

    def explode(news: Progress) -> None:
        raise ValueError("the listener broke")

    with anyio.fail_after(10):
        async with AsyncClient(endpoint) as client, anyio.create_task_group() as tg:

            async def play_daemon() -> None:
                identities = await senders(daemon, 2)
                await daemon.send_multipart([identities["dropped"], b"", encode(progress(1))])
                await anyio.sleep(0.1)  # its listener has raised; its Cancel waits
                await daemon.send_multipart([identities["dropped"], b"", encode(progress(2))])
                await anyio.sleep(0.1)
                await daemon.send_multipart([identities["kept"], b"", encode(Result(
                    request_id="kept", outputs=[], stages=[], total_ms=3.0))])

            async def dropped() -> None:
                with pytest.raises(ValueError, match="the listener broke"):
                    await client.submit(PARAMS, request_id="dropped", on_progress=explode)

            tg.start_soon(play_daemon)
            tg.start_soon(dropped)
            await anyio.sleep(0.05)
            assert (await client.submit(PARAMS, request_id="kept", timeout_s=5)).result.total_ms == 3.0




