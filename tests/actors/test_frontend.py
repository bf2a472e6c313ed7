"""FrontendActor with a real ROUTER on ipc:// (in tmp_path), a DEALER client and a fake tracker.

Each admission gets its own internal key, ``f"{client's id}#{n}"``, used everywhere inside
the daemon; replies go back to the client under the client's own id. Duplicates and cancels
are judged by the client's id.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream

import orchestrator.async_client as client_module
from actors import frontend
from actors.base import ask_stats
from actors.frontend import FrontendActor, FrontendStats
from actors.mail import CLIENT_GONE, Admit, CancelRequest, Deliver, FrontendMail, LimitsChanged, SetDraining
from actors.mailbox import Mailbox, Switchboard
from orchestrator.client import AsyncClient, Rejection
from orchestrator.client_wire import CancelTokens
from orchestrator.config import DaemonConfig
from tests.actors.streams import assert_empty, open_stream
from transfer.protocol import (
    CLIENT_REPLY,
    PROTOCOL_VERSION,
    ROLES,
    Cancel,
    Cancelled,
    ClientReply,
    GenParams,
    Progress,
    Reason,
    Rejected,
    Result,
    StageLimits,
    Submit,
    TensorSpec,
    encode,
)

PARAMS = GenParams(prompt="p")
OUTPUTS = [TensorSpec(name="image", dtype="uint8", shape=(4,), offset=0, nbytes=4)]


@dataclass
class Frontend:
    inbox: Mailbox[FrontendMail]
    tracker: MemoryObjectReceiveStream[Any]
    client: zmq.asyncio.Socket
    cfg: DaemonConfig

    async def stats(self) -> FrontendStats:
        """Ask for stats; the answer also proves every earlier mail was handled."""
        return await ask_stats(self.inbox)

    async def ask(self, request: Submit | Cancel) -> None:
        await self.client.send_multipart([b"", encode(request)])

    async def reply(self) -> tuple[ClientReply, list[bytes]]:
        empty, body, *frames = await self.client.recv_multipart()
        assert empty == b""
        return CLIENT_REPLY.decode(body), frames

    async def admitted(self, rid: str, cancel_token: str = "") -> str:
        """Submit ``rid`` and return the internal key the tracker is told to admit it under."""
        await self.ask(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, request_id=rid, cancel_token=cancel_token))
        admit = await self.tracker.receive()
        assert isinstance(admit, Admit) and admit.params == PARAMS
        assert admit.timeout_s == self.cfg.request_timeout_s
        return admit.request_id


@asynccontextmanager
async def running_frontend(ctx: zmq.asyncio.Context, tmp_path: Path, **settings: Any) -> AsyncIterator[Frontend]:
    cfg = DaemonConfig(client_endpoint=f"ipc://{tmp_path}/clients", **settings)
    async with AsyncExitStack() as stack:
        board = Switchboard()
        inbox = board.mailbox("frontend", 32)
        tracker_box, tracker_rx = open_stream(stack, board, "tracker")
        actor = FrontendActor(inbox, ctx=ctx, cfg=cfg, tracker=tracker_box)
        for role in ROLES:  # a worker of each role is registered, with the default limits
            inbox.post(LimitsChanged(role=role, instance=f"{role}-0", limits=StageLimits()))
        async with anyio.create_task_group() as tg:
            endpoint = await tg.start(actor.run)
            client = ctx.socket(zmq.DEALER)
            client.setsockopt(zmq.LINGER, 0)
            try:
                client.connect(endpoint)
                yield Frontend(inbox, tracker_rx, client, cfg)
            finally:
                client.close(linger=0)
                tg.cancel_scope.cancel()  # run is cancelled and closes the ROUTER


async def test_each_admission_gets_its_own_key_and_replies_carry_the_clients_id(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path) as f:
            assert await f.admitted("rid") == "rid#0"

            # The same id while the first is in flight: a duplicate, and the tracker hears nothing.
            await f.ask(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, request_id="rid"))
            rejected, frames = await f.reply()
            assert isinstance(rejected, Rejected) and frames == []
            assert (rejected.request_id, rejected.reason) == ("rid", Reason.DUPLICATE)
            assert (await f.stats()).in_flight == 1
            assert_empty(f.tracker)

            # The result comes back under the key; the client sees its own id, frames untouched.
            result = Result(request_id="rid#0", outputs=OUTPUTS, stages=[], total_ms=1.0)
            f.inbox.post(Deliver(request_id="rid#0", message=result, frames=[b"\x01\x02\x03\x04"]))
            reply, frames = await f.reply()
            assert reply == Result(request_id="rid", outputs=OUTPUTS, stages=[], total_ms=1.0)
            assert frames == [b"\x01\x02\x03\x04"]
            assert (await f.stats()).in_flight == 0

            # The client reuses its id: accepted again, under a key never used before.
            assert await f.admitted("rid") == "rid#1"
            assert await f.admitted("other") == "other#2"
            assert (await f.stats()).in_flight == 2


async def test_news_about_an_earlier_admission_never_reaches_the_reused_id(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Race C at the frontend: a late Deliver for "rid#0" is not taken for "rid#1"."""
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path) as f:
            first = await f.admitted("rid")
            failed = Rejected(request_id=first, reason=Reason.TIMED_OUT, message="deadline passed")
            f.inbox.post(Deliver(request_id=first, message=failed))
            reply, _ = await f.reply()
            assert reply == Rejected(request_id="rid", reason=Reason.TIMED_OUT, message="deadline passed")
            second = await f.admitted("rid")
            assert second != first

            f.inbox.post(Deliver(request_id=first, message=failed))  # stale: dropped
            assert (await f.stats()).in_flight == 1
            await f.ask(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, request_id="rid"))
            duplicate, _ = await f.reply()  # the first thing the client hears: "rid#1" is still in flight
            assert isinstance(duplicate, Rejected) and duplicate.reason == Reason.DUPLICATE

            # A cancel names the client's id and reaches the tracker as the current key.
            await f.ask(Cancel(protocol=PROTOCOL_VERSION, request_id="rid"))
            assert await f.reply() == (Cancelled(request_id="rid", found=True), [])
            assert await f.tracker.receive() == CancelRequest(request_id=second)
            cancelled = Rejected(request_id=second, reason=Reason.CANCELLED, message="cancelled by the client")
            f.inbox.post(Deliver(request_id=second, message=cancelled))
            reply, _ = await f.reply()
            assert reply == Rejected(request_id="rid", reason=Reason.CANCELLED, message="cancelled by the client")

            await f.ask(Cancel(protocol=PROTOCOL_VERSION, request_id="rid"))  # nothing in flight now
            assert await f.reply() == (Cancelled(request_id="rid", found=False), [])
            assert (await f.stats()).in_flight == 0
            assert_empty(f.tracker)


async def test_a_submit_its_cancel_overtook_is_refused_as_cancelled(ctx: zmq.asyncio.Context, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupted blocking client cancels on a fresh connection, and the ROUTER may read
    that Cancel first: the Submit that follows within CANCEL_OVERTAKES_S is not run for nobody."""
    monkeypatch.setattr(frontend, "CANCEL_OVERTAKES_S", 0.2)
    monkeypatch.setattr(frontend, "FORESEEN_CANCELS", 8)
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path) as f:
            await f.ask(Cancel(protocol=PROTOCOL_VERSION, request_id="early"))
            assert await f.reply() == (Cancelled(request_id="early", found=False), [])
            await f.ask(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, request_id="early"))
            refused, _ = await f.reply()
            assert isinstance(refused, Rejected) and refused.reason == Reason.CANCELLED
            assert "its Cancel came first" in refused.message
            assert_empty(f.tracker)
            await f.admitted("early")  # once: the id is free again
            # Only for a moment, and only so many of them.
            await f.ask(Cancel(protocol=PROTOCOL_VERSION, request_id="late"))
            await f.reply()
            await anyio.sleep(0.3)
            await f.admitted("late")
            for i in range(20):
                await f.ask(Cancel(protocol=PROTOCOL_VERSION, request_id=f"c{i}"))
                await f.reply()
            await f.admitted("c0")  # forgotten: the oldest go past FORESEEN_CANCELS
            await f.ask(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, request_id="c19"))
            assert (await f.reply())[0].reason == Reason.CANCELLED
            assert (await f.stats()).refused == {"cancelled": 2}


async def test_a_request_submitted_with_a_cancel_token_is_cancelled_only_by_a_cancel_carrying_it(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Before, any client that knew (or guessed) an id could cancel another's request."""
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path) as f:
            key = await f.admitted("mine", cancel_token="secret")
            for token in ("", "guess"):
                await f.ask(Cancel(protocol=PROTOCOL_VERSION, request_id="mine", cancel_token=token))
                assert await f.reply() == (Cancelled(request_id="mine", found=False, refused=True), [])
            assert_empty(f.tracker)
            assert (await f.stats()).in_flight == 1
            await f.ask(Cancel(protocol=PROTOCOL_VERSION, request_id="mine", cancel_token="secret"))
            assert await f.reply() == (Cancelled(request_id="mine", found=True), [])
            assert await f.tracker.receive() == CancelRequest(request_id=key)
            # A request submitted without one is anyone's to cancel, as before tokens.
            key = await f.admitted("open")
            await f.ask(Cancel(protocol=PROTOCOL_VERSION, request_id="open", cancel_token="anything"))
            assert await f.reply() == (Cancelled(request_id="open", found=True), [])
            assert await f.tracker.receive() == CancelRequest(request_id=key)


async def test_a_cancel_that_overtook_a_submit_refuses_only_a_submit_with_its_token(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Before, a Cancel of an id not yet in flight kept any client's Submit of that id from
    running for a second."""
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path) as f:
            await f.ask(Cancel(protocol=PROTOCOL_VERSION, request_id="next", cancel_token="someone else's"))
            assert await f.reply() == (Cancelled(request_id="next", found=False), [])
            await f.admitted("next", cancel_token="mine")
            await f.ask(Cancel(protocol=PROTOCOL_VERSION, request_id="later", cancel_token="mine"))
            await f.reply()
            await f.ask(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, request_id="later", cancel_token="mine"))
            refused, _ = await f.reply()
            assert isinstance(refused, Rejected) and refused.reason == Reason.CANCELLED


async def test_a_cancel_that_came_late_does_not_refuse_the_ids_next_request(ctx: zmq.asyncio.Context,
                                                                              tmp_path: Path) -> None:
    """The Cancel crossed its request's Result (or a blocking client that timed out cancels
    after the answer came): it found nothing because it was late, not early."""
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path) as f:
            key = await f.admitted("job")
            f.inbox.post(Deliver(request_id=key, message=Result(request_id=key, outputs=OUTPUTS, stages=[],
                                                                 total_ms=1.0), frames=[b"\0" * 4]))
            assert isinstance((await f.reply())[0], Result)
            await f.ask(Cancel(protocol=PROTOCOL_VERSION, request_id="job"))
            assert await f.reply() == (Cancelled(request_id="job", found=False), [])
            await f.admitted("job")


async def test_a_submit_without_an_id_gets_one(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path) as f:
            key = await f.admitted("")
            rid, n = key.rsplit("#", 1)
            assert len(rid) == 32 and n == "0"
            f.inbox.post(Deliver(request_id=key, message=Rejected(request_id=key, reason=Reason.STAGE_FAILED,
                                                                  message="nan")))
            reply, _ = await f.reply()
            assert reply.request_id == rid


def lost(key: str, reason: Reason = Reason.WORKER_LOST) -> Deliver:
    return Deliver(request_id=key, message=Rejected(request_id=key, reason=reason, message="gone"))


@pytest.mark.parametrize(("reason", "retried"), [
    (Reason.WORKER_LOST, True),
    (Reason.TRANSFER_FAILED, True),  # a hand-off that could not reach its receiver
    (Reason.STAGE_FAILED, False),  # the request itself is at fault: again would fail again
    (Reason.TIMED_OUT, False),
    (Reason.CANCELLED, False),
])
async def test_only_failures_of_the_pipeline_are_retried(ctx: zmq.asyncio.Context, tmp_path: Path,
                                                         reason: Reason, retried: bool) -> None:
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path) as f:
            key = await f.admitted("r")
            f.inbox.post(lost(key, reason))
            if retried:
                assert (await f.tracker.receive()).request_id == "r#1"
            else:
                assert (await f.reply())[0] == Rejected(request_id="r", reason=reason, message="gone")
            assert (await f.stats()).retried == int(retried)


async def test_a_request_whose_worker_was_lost_starts_again_once_under_a_new_key(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path) as f:
            await f.ask(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, request_id="r", priority=7))
            first = await f.tracker.receive()
            f.inbox.post(lost(first.request_id))
            again = await f.tracker.receive()  # the client hears nothing yet
            assert isinstance(again, Admit) and again.request_id == "r#1" and again.again  # first in its line
            assert (again.params, again.priority) == (PARAMS, 7)
            assert 0 < again.timeout_s <= first.timeout_s  # what is left of the deadline, never more
            assert again.submitted_at == first.submitted_at  # its times count from the client's submit
            stats = await f.stats()
            assert (stats.in_flight, stats.retried) == (1, 1)

            # Lost again: retries are spent (retries = 1), so the client hears why.
            f.inbox.post(lost("r#1"))
            reply, _ = await f.reply()
            assert reply == Rejected(request_id="r", reason=Reason.WORKER_LOST, message="gone")
            assert (await f.stats()).in_flight == 0
            assert_empty(f.tracker)

            # A retried request's result reaches its client like any other.
            await f.admitted("s")
            f.inbox.post(lost("s#2"))
            assert (await f.tracker.receive()).request_id == "s#3"
            f.inbox.post(Deliver(request_id="s#3", message=Result(request_id="s#3", outputs=OUTPUTS, stages=[],
                                                                  total_ms=1.0), frames=[b"\x00" * 4]))
            assert await f.reply() == (Result(request_id="s", outputs=OUTPUTS, stages=[], total_ms=1.0), [b"\x00" * 4])


async def test_each_retry_avoids_every_instance_its_failed_attempts_involved(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path, retries=2) as f:
            await f.ask(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, request_id="r"))
            first = await f.tracker.receive()
            assert first.avoid == frozenset()
            f.inbox.post(msgspec.structs.replace(lost(first.request_id, Reason.TRANSFER_FAILED),
                                                 avoid=frozenset({"encoder-1", "denoiser-2"})))
            second = await f.tracker.receive()
            assert second.avoid == {"encoder-1", "denoiser-2"}
            f.inbox.post(msgspec.structs.replace(lost(second.request_id), avoid=frozenset({"denoiser-3"})))
            assert (await f.tracker.receive()).avoid == {"encoder-1", "denoiser-2", "denoiser-3"}


async def test_a_submit_that_reaches_a_stopping_daemon_unread_is_answered_draining(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Sent in the last moments of a drain, after the socket's last read: before, it got no
    answer at all, and its client waited out its whole deadline (seen in a soak)."""
    late = ctx.socket(zmq.DEALER)
    late.setsockopt(zmq.LINGER, 0)
    try:
        with anyio.fail_after(5):
            async with running_frontend(ctx, tmp_path) as f:
                await f.stats()
                late.connect(f.cfg.client_endpoint)
                await late.send_multipart([b"", encode(Submit(protocol=PROTOCOL_VERSION, params=PARAMS,
                                                              request_id="late"))])
                time.sleep(0.2)  # it lands on the socket; the loop, blocked, does not read it
            # Stopped (the harness cancels the actor on leaving): the answer was sent on the way out.
            empty, body = await late.recv_multipart()
        reply = CLIENT_REPLY.decode(body)
        assert isinstance(reply, Rejected) and (reply.request_id, reply.reason) == ("late", Reason.DRAINING)
    finally:
        late.close(linger=0)


async def test_no_retry_past_the_deadline_or_while_draining(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path) as f:
            await f.ask(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, request_id="late", timeout_s=0.05))
            late = await f.tracker.receive()
            await anyio.sleep(0.1)
            f.inbox.post(lost(late.request_id))
            assert (await f.reply())[0].reason == Reason.WORKER_LOST

            key = await f.admitted("drained")
            f.inbox.post(SetDraining())
            f.inbox.post(lost(key))  # the drain may already count it as ended: answer now
            assert (await f.reply())[0].reason == Reason.WORKER_LOST
            assert (await f.stats()).retried == 0
            assert_empty(f.tracker)


async def test_a_failure_that_crossed_a_cancel_ends_the_request_as_cancelled(ctx: zmq.asyncio.Context,
                                                                          tmp_path: Path) -> None:
    """The worker was lost, and its news was on its way here, when the client cancelled: the
    client was told found=True, so the request ends as cancelled, not started again."""
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path, retries=2) as f:  # it could start again
            await f.ask(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, request_id="rid"))
            f.inbox.post(lost((await f.tracker.receive()).request_id))
            retried = await f.tracker.receive()
            await f.ask(Cancel(protocol=PROTOCOL_VERSION, request_id="rid"))  # reaches the new admission
            assert await f.reply() == (Cancelled(request_id="rid", found=True), [])
            assert await f.tracker.receive() == CancelRequest(request_id=retried.request_id)
            f.inbox.post(lost(retried.request_id))
            assert await f.reply() == (Rejected(request_id="rid", reason=Reason.CANCELLED,
                                                message="cancelled by the client"), [])
            assert (await f.stats()).retried == 1
            assert_empty(f.tracker)


async def test_the_submits_priority_reaches_the_tracker(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path) as f:
            await f.ask(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, request_id="r", priority=42))
            admit = await f.tracker.receive()
            assert isinstance(admit, Admit) and admit.priority == 42


async def test_a_submit_past_the_wires_bounds_on_its_id_or_priority_is_refused_at_the_door(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """A 129-character id or a priority outside -100..100 is refused as invalid, naming the
    field, and never admitted; the bounds themselves are admitted."""
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path) as f:
            for fields, path in (({"request_id": "r" * 129}, "request_id"), ({"priority": 101}, "priority"),
                                 ({"priority": -101}, "priority")):
                await f.ask(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, **fields))
                rejected, _ = await f.reply()
                assert isinstance(rejected, Rejected) and rejected.reason == Reason.INVALID
                assert rejected.message.startswith("invalid request:") and rejected.message.endswith(f"`$.{path}`")
            assert_empty(f.tracker)
            assert (await f.admitted("r" * 128)).startswith("r" * 128 + "#")
            for priority in (100, -100):
                await f.ask(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, priority=priority))
                admit = await f.tracker.receive()
                assert isinstance(admit, Admit) and admit.priority == priority


async def test_a_submit_naming_a_generation_parameter_the_daemon_lacks_is_refused(ctx: zmq.asyncio.Context,
                                                                                tmp_path: Path,
                                                                                logs: list[dict]) -> None:
    """A client's ``"scheduler": "euler"`` (a field GenParams has not) would be skipped and the
    configured scheduler run: it is refused as invalid, naming the field, and never admitted.
    Unknown fields elsewhere in a Submit are skipped (the compatibility rule), and a newer
    client's GenParams field is its version's, refused unsupported."""
    submit = msgspec.to_builtins(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, request_id="r"))
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path) as f:
            await f.client.send_multipart([b"", msgspec.msgpack.encode(
                submit | {"params": submit["params"] | {"scheduler": "euler"}})])
            rejected, _ = await f.reply()
            assert isinstance(rejected, Rejected) and rejected.reason == Reason.INVALID
            assert rejected.message == "invalid request: Object contains unknown field `scheduler` - at `$.params`"
            assert_empty(f.tracker)
            await f.client.send_multipart([b"", msgspec.msgpack.encode(submit | {"newer": 1})])
            admit = await f.tracker.receive()
            assert isinstance(admit, Admit) and admit.params == PARAMS
            # A newer client's field is one of its version's: it hears of the version, under its id.
            newer = submit | {"protocol": PROTOCOL_VERSION + 1, "request_id": "r2",
                              "params": submit["params"] | {"strength": 0.5}}
            await f.client.send_multipart([b"", msgspec.msgpack.encode(newer)])
            rejected, _ = await f.reply()
            says = f"protocol {PROTOCOL_VERSION + 1}; this daemon speaks {PROTOCOL_VERSION}"
            assert rejected == Rejected(request_id="r2", reason=Reason.UNSUPPORTED, message=says)
    # Each refusal is a line of the log too (none was: only counted).
    assert [(e["request_id"], e["reason"]) for e in logs if e["event"] == "request.refused"] == [
        ("", "invalid"), ("r2", "unsupported")]


async def test_progress_reaches_its_client_under_its_id_and_leaves_the_request_in_flight(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path) as f:
            await f.ask(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, request_id="r", progress=True))
            admit = await f.tracker.receive()
            assert isinstance(admit, Admit) and admit.progress
            news = Progress(request_id=admit.request_id, state="denoising", elapsed_ms=12.5, step=3, steps=20)
            f.inbox.post(Deliver(request_id=admit.request_id, message=news))
            assert await f.reply() == (msgspec.structs.replace(news, request_id="r"), [])
            assert (await f.stats()).in_flight == 1
            result = Result(request_id=admit.request_id, outputs=OUTPUTS, stages=[], total_ms=1.0)
            f.inbox.post(Deliver(request_id=admit.request_id, message=result))
            assert (await f.reply())[0] == msgspec.structs.replace(result, request_id="r")
            f.inbox.post(Deliver(request_id=admit.request_id, message=news))  # late: nobody to tell
            assert (await f.stats()).in_flight == 0
            assert not await f.client.poll(100)


async def test_past_max_in_flight_submits_are_overloaded_until_one_ends(ctx: zmq.asyncio.Context,
                                                                        tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path, max_in_flight=2) as f:
            first = await f.admitted("a")
            await f.admitted("b")
            await f.ask(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, request_id="c"))
            rejected, _ = await f.reply()
            assert rejected == Rejected(request_id="c", reason=Reason.OVERLOADED,
                                        message="2 requests in flight (max_in_flight)")
            assert_empty(f.tracker)
            f.inbox.post(Deliver(request_id=first, message=Result(request_id=first, outputs=[], stages=[],
                                                                  total_ms=1.0)))
            await f.reply()
            assert await f.admitted("c") == "c#2"


async def test_a_cancel_of_a_submit_refused_at_the_door_came_late_not_early(ctx: zmq.asyncio.Context,
                                                                          tmp_path: Path) -> None:
    """Its caller gave up before the refusal came, and its Cancel finds nothing: that id's
    next Submit must not be refused as one its Cancel overtook."""
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path, max_in_flight=1) as f:
            first = await f.admitted("a")
            await f.ask(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, request_id="c"))
            assert (await f.reply())[0].reason == Reason.OVERLOADED
            await f.ask(Cancel(protocol=PROTOCOL_VERSION, request_id="c"))
            assert (await f.reply())[0] == Cancelled(request_id="c", found=False)
            f.inbox.post(Deliver(request_id=first, message=Result(request_id=first, outputs=[], stages=[],
                                                                  total_ms=1.0)))
            await f.reply()
            assert await f.admitted("c") == "c#1"  # admitted, not refused cancelled


async def test_a_submits_timeout_is_capped_by_max_request_timeout_s(ctx: zmq.asyncio.Context,
                                                                    tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path, max_request_timeout_s=5.0, request_timeout_s=5.0) as f:
            for asked, given in ((100.0, 5.0), (2.0, 2.0)):
                await f.ask(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, timeout_s=asked))
                admit = await f.tracker.receive()
                assert admit.timeout_s == given


async def test_the_door_checks_every_registered_workers_limits(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """Wider limits registered last do not open the door past a tighter worker's; once the
    tighter one leaves, they do."""
    wide = GenParams(prompt="p", width=48, height=16)
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path) as f:
            f.inbox.post(LimitsChanged(role="denoiser", instance="denoiser-1", limits=StageLimits(max_size=32)))
            f.inbox.post(LimitsChanged(role="denoiser", instance="denoiser-2", limits=StageLimits(max_size=64)))
            await f.ask(Submit(protocol=PROTOCOL_VERSION, params=wide, request_id="w"))
            rejected, _ = await f.reply()
            assert rejected == Rejected(request_id="w", reason=Reason.INVALID,
                                        message="width 48 is outside [8, 32] for model ''")
            assert_empty(f.tracker)
            f.inbox.post(LimitsChanged(role="denoiser", instance="denoiser-1", limits=None))
            await f.ask(Submit(protocol=PROTOCOL_VERSION, params=wide, request_id="w"))
            admit = await f.tracker.receive()
            assert isinstance(admit, Admit) and admit.params == wide


async def test_a_raw_output_past_worker_max_message_bytes_is_refused_at_the_door(ctx: zmq.asyncio.Context,
                                                                                 tmp_path: Path) -> None:
    """A raw output's size is known from the request (N x H x W x 3 bytes): one past the
    frame the daemon takes from its decoder is refused before any stage runs, not after
    the whole pipeline has computed it for the decoder to refuse (measured: a 3 s denoise
    spent on a 1024 x 1024 request that could only fail). PNG sizes are not known before
    encoding: those the decoder checks."""
    limit = 1 << 20
    over = GenParams(prompt="p", width=1024, height=1024, output="raw")  # 3,145,728 bytes
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path, worker_max_message_bytes=limit) as f:
            await f.ask(Submit(protocol=PROTOCOL_VERSION, params=over, request_id="big"))
            rejected, _ = await f.reply()
            assert rejected == Rejected(request_id="big", reason=Reason.INVALID, message=(
                "output 'images' would be 3145728 bytes, more than the daemon takes in one frame "
                f"(daemon.worker_max_message_bytes = {limit}): ask for fewer or smaller images, or raise the limit"))
            assert_empty(f.tracker)
            assert (await f.stats()).refused == {"invalid": 1}
            for fits in (msgspec.structs.replace(over, output="png"),  # its size unknown until encoded
                         GenParams(prompt="p", width=512, height=512, output="raw")):  # 786,432 bytes
                await f.ask(Submit(protocol=PROTOCOL_VERSION, params=fits, request_id=fits.output))
                admit = await f.tracker.receive()
                assert isinstance(admit, Admit) and admit.params == fits


async def test_a_client_that_leaves_has_its_request_cancelled_at_once(ctx: zmq.asyncio.Context,
                                                                      tmp_path: Path) -> None:
    """The socket's monitor says the connection closed: the request is cancelled then, not
    computed to its end for nobody. Its end, crossing the cancel, finds no client and is no
    reply lost: the daemon knew."""
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path) as f:
            key = await f.admitted("gone")
            f.client.close(linger=0)
            assert await f.tracker.receive() == CancelRequest(request_id=key, why=CLIENT_GONE)
            f.inbox.post(Deliver(request_id=key, message=Result(request_id=key, outputs=[], stages=[], total_ms=1.0)))
            stats = await f.stats()
            assert (stats.replies_dropped, stats.in_flight) == (0, 0)
            assert_empty(f.tracker)


async def test_a_client_that_sends_and_leaves_at_once_has_nothing_computed_for_it(ctx: zmq.asyncio.Context,
                                                                                  tmp_path: Path) -> None:
    """Its close is mostly queued before its Submit is read, and nothing would say it again
    (an audit: 609 of 1,000 such requests ran to their end for nobody): refused as cancelled,
    never admitted; or, read before its close, admitted and cancelled by it."""
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path) as f:
            await f.ask(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, request_id="left"))
            f.client.close(linger=1000)  # the Submit leaves first
            while (await f.stats()).refused != {"cancelled": 1}:
                try:
                    admit = f.tracker.receive_nowait()
                except anyio.WouldBlock:
                    await anyio.sleep(0.01)
                    continue
                assert isinstance(admit, Admit)
                assert await f.tracker.receive() == CancelRequest(request_id=admit.request_id, why=CLIENT_GONE)
                break
            assert_empty(f.tracker)


async def test_the_progress_and_end_of_a_request_its_client_cancelled_are_not_counted_lost(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """A client that cancels may leave at once (triptych submit on Ctrl-C): a Step relayed
    between its Cancel and the request's end found it gone and counted as a lost reply (a
    flaky end-to-end test)."""
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path) as f:
            key = await f.admitted("left")
            await f.ask(Cancel(protocol=PROTOCOL_VERSION, request_id="left"))
            assert await f.tracker.receive() == CancelRequest(request_id=key)
            f.client.close(linger=0)
            await anyio.sleep(0.3)  # the ROUTER hears the connection close: no second cancel
            f.inbox.post(Deliver(request_id=key, message=Progress(request_id=key, state="denoising",
                                                                  elapsed_ms=1.0, step=3, steps=20)))
            f.inbox.post(Deliver(request_id=key, message=Rejected(request_id=key, reason=Reason.CANCELLED,
                                                                  message="cancelled by the client")))
            stats = await f.stats()
            assert (stats.replies_dropped, stats.in_flight) == (0, 0)
            assert_empty(f.tracker)


async def test_a_connection_that_closes_has_what_it_asked_for_cancelled_and_no_more(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Only that connection's requests: another client's goes on, and the cancelled ones
    end as any cancel does (their replies dropped, uncounted), without a second round of
    cancels or a retry."""
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path) as f:
            other = ctx.socket(zmq.DEALER)
            other.connect(f.cfg.client_endpoint)
            try:
                await other.send_multipart([b"", encode(Submit(protocol=PROTOCOL_VERSION, params=PARAMS,
                                                               request_id="stays"))])
                stays = (await f.tracker.receive()).request_id
                watched = [await f.admitted(rid) for rid in ("a", "b")]
                f.client.close(linger=0)
                cancels = {await f.tracker.receive(), await f.tracker.receive()}
                assert cancels == {CancelRequest(request_id=key, why=CLIENT_GONE) for key in watched}
                f.inbox.post(Deliver(request_id=watched[0], message=Progress(
                    request_id=watched[0], state="denoising", elapsed_ms=1.0, step=1, steps=20)))
                # One had failed in a way that is retried, its news already on its way: not
                # started again for a client that is gone.
                f.inbox.post(lost(watched[0]))
                f.inbox.post(Deliver(request_id=watched[1], message=Rejected(
                    request_id=watched[1], reason=Reason.CANCELLED, message="its client's connection closed")))
                stats = await f.stats()
                # Neither the progress (not sent) nor the two ends the daemon's own cancels made.
                assert (stats.in_flight, stats.replies_dropped) == (1, 0)
                assert_empty(f.tracker)
                f.inbox.post(Deliver(request_id=stays, message=Result(request_id=stays, outputs=[], stages=[],
                                                                      total_ms=1.0)))
                empty, body = await other.recv_multipart()
                assert CLIENT_REPLY.decode(body).request_id == "stays"
            finally:
                other.close(linger=0)


async def test_a_client_watching_progress_hears_of_a_retry_and_why(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path) as f:
            await f.ask(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, request_id="r", progress=True))
            first = await f.tracker.receive()
            f.inbox.post(lost(first.request_id))
            retrying, _ = await f.reply()
            assert isinstance(retrying, Progress) and retrying.request_id == "r"
            assert (retrying.state, retrying.why) == ("retrying", "gone") and retrying.elapsed_ms >= 0
            again = await f.tracker.receive()
            assert again.progress and again.submitted_at == first.submitted_at


@pytest.mark.parametrize("push_quarantine_s", [0.001, 60.0], ids=["daemon past it", "daemon younger than it"])
async def test_a_timeout_says_which_roles_no_worker_serves(push_quarantine_s: float, ctx: zmq.asyncio.Context,
                                                          tmp_path: Path) -> None:
    """And, within push_quarantine_s of the daemon's start, that after a crash the
    receivers sit that out before they rejoin (an operator audit: nothing said so)."""
    with anyio.fail_after(5):
        async with running_frontend(ctx, tmp_path, push_quarantine_s=push_quarantine_s) as f:
            f.inbox.post(LimitsChanged(role="denoiser", instance="denoiser-0", limits=None))
            key = await f.admitted("r")
            await anyio.sleep(0.01)  # past the short quarantine
            f.inbox.post(Deliver(request_id=key, message=Rejected(request_id=key, reason=Reason.TIMED_OUT,
                                                                  message="deadline passed while waiting")))
            reply, _ = await f.reply()
            hint = ("" if push_quarantine_s < 1 else
                    " (this daemon started 0s ago: the denoisers and decoders of one that stopped without its "
                    "farewell, a crash, rejoin after daemon.push_quarantine_s, 60s)")
            assert reply == Rejected(request_id="r", reason=Reason.TIMED_OUT,
                                     message=f"deadline passed while waiting; no denoiser worker is registered{hint}")


async def test_a_burst_of_replies_to_a_reading_client_arrives_whole_and_in_order(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Hundreds of submits refused in one turn: far more replies than ZMQ queues for one
    connection (client_send_hwm) before its I/O thread moves them. The rest are held and
    sent as room appears; none is dropped."""
    with anyio.fail_after(10):
        async with running_frontend(ctx, tmp_path, max_in_flight=1, client_send_hwm=2) as f:
            await f.admitted("first")
            for i in range(300):
                await f.ask(Submit(protocol=PROTOCOL_VERSION, params=PARAMS, request_id=f"r{i}"))
            replies = [(await f.reply())[0] for _ in range(300)]
            assert [(r.request_id, r.reason) for r in replies if isinstance(r, Rejected)] == [
                (f"r{i}", Reason.OVERLOADED) for i in range(300)]
            assert (await f.stats()).replies_dropped == 0


async def test_a_clients_own_cancel_that_meets_another_clients_request_is_an_ack_not_an_answer(
    ctx: zmq.asyncio.Context, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gives up on "x"; x's Result crosses A's Cancel, and B submits "x" before that Cancel
    arrives. An audit found the Cancel's refusal, then a Rejected, taken by A for the answer
    to its next submit of "x", whose real answer was dropped."""
    leave = client_module._cancel_at_daemon
    left = anyio.Event()

    async def late_cancel(sock: zmq.asyncio.Socket, request_ids: list[str], tokens: CancelTokens) -> int:
        with anyio.CancelScope(shield=True):
            await anyio.sleep(0.5)  # as a send behind a full queue
        sent = await leave(sock, request_ids, tokens)
        left.set()
        return sent

    monkeypatch.setattr(client_module, "_cancel_at_daemon", late_cancel)
    with anyio.fail_after(10):
        async with running_frontend(ctx, tmp_path) as f:
            endpoint = f.cfg.client_endpoint
            async with AsyncClient(endpoint) as a, AsyncClient(endpoint) as b, anyio.create_task_group() as tg:
                give_up = anyio.CancelScope()

                async def submit_then_give_up() -> None:
                    with give_up:
                        await a.submit(PARAMS, request_id="x")

                tg.start_soon(submit_then_give_up)
                admit = await f.tracker.receive()
                give_up.cancel()  # A's Cancel leaves 0.5 s from now
                f.inbox.post(Deliver(request_id=admit.request_id, frames=[b"\0" * 4], message=Result(
                    request_id=admit.request_id, outputs=OUTPUTS, stages=[], total_ms=1.0)))
                await anyio.sleep(0.1)  # the Result reached A
                tg.start_soon(partial(b.submit, PARAMS, request_id="x"))
                assert isinstance(await f.tracker.receive(), Admit)
                await left.wait()
                with pytest.raises(Rejection) as caught:
                    await a.submit(PARAMS, request_id="x", timeout_s=5)
                assert caught.value.reason == Reason.DUPLICATE  # its own answer: B's "x" is in flight
                assert_empty(f.tracker)  # A's Cancel stopped nothing
                tg.cancel_scope.cancel()


async def test_a_message_of_millions_of_frames_is_refused_after_its_first_few(ctx: zmq.asyncio.Context,
                                                                              tmp_path: Path) -> None:
    """Each frame is within the size limit; the rest of the message is dropped unread."""
    async with running_frontend(ctx, tmp_path) as fe:
        await fe.client.send_multipart([b"", *[b""] * 200_000, b"last"])
        await fe.ask(Cancel(protocol=PROTOCOL_VERSION, request_id="after"))
        with anyio.fail_after(10):
            assert (await fe.reply())[0] == Rejected(
                request_id="", reason=Reason.INVALID,
                message=f"invalid request: expected [empty, body] frames, "
                        f"got {frontend.CLIENT_FRAMES_READ - 1} or more")
            assert (await fe.reply())[0] == Cancelled(request_id="after", found=False)
        assert (await fe.stats()).refused == {Reason.INVALID: 1}
