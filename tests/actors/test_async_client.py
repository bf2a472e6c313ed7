"""AsyncClient against a fake daemon: progress reaches the caller's task, and a caller that
stops listening (its on_progress raised) cancels the request at the daemon."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import zmq
import zmq.asyncio

from orchestrator.client import AsyncClient, Client, Generation, Rejection
from transfer.protocol import (
    CLIENT_REQUEST,
    Cancel,
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


async def test_progress_comes_before_the_result_and_a_raising_listener_cancels_the_request(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    daemon = ctx.socket(zmq.ROUTER)
    daemon.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/daemon"
    daemon.bind(endpoint)

    async def receive() -> tuple[bytes, object]:
        identity, empty, body = await daemon.recv_multipart()
        return identity, CLIENT_REQUEST.decode(body)

    async def reply(identity: bytes, message: object) -> None:
        await daemon.send_multipart([identity, b"", encode(message)])

    def progress(rid: str, step: int) -> Progress:
        return Progress(request_id=rid, state="denoising", elapsed_ms=float(step), step=step, steps=4)

    try:
        with anyio.fail_after(10):
            async with AsyncClient(endpoint) as client, anyio.create_task_group() as tg:
                heard: list[Progress] = []

                async def answer_with_progress() -> None:
                    identity, submit = await receive()
                    assert isinstance(submit, Submit) and submit.progress and submit.request_id == "r1"
                    for step in (1, 2):
                        await reply(identity, progress("r1", step))
                    await reply(identity, Result(request_id="r1", outputs=[], stages=[], total_ms=3.0))
                    await reply(identity, progress("r1", 3))  # after the answer: nobody listens

                tg.start_soon(answer_with_progress)
                generation = await client.submit(PARAMS, request_id="r1", on_progress=heard.append)
                assert generation.result.total_ms == 3.0
                assert [p.step for p in heard] == [1, 2]

                def explode(news: Progress) -> None:
                    raise ValueError(f"the caller's listener broke at step {news.step}")

                async def answer_then_expect_cancel() -> None:
                    identity, submit = await receive()
                    assert isinstance(submit, Submit) and submit.request_id == "r2"
                    await reply(identity, progress("r2", 1))
                    _, cancel = await receive()
                    assert cancel == Cancel(protocol=submit.protocol, request_id="r2")

                tg.start_soon(answer_then_expect_cancel)
                with pytest.raises(ValueError, match="broke at step 1"):
                    await client.submit(PARAMS, request_id="r2", on_progress=explode)
    finally:
        daemon.close(linger=0)


async def test_a_submit_the_daemon_would_refuse_is_refused_at_once_and_never_sent(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """A prompt of megabytes would be cut off unread at the daemon's size limit and get no
    answer at all: both clients check a Submit as the daemon will, before sending it."""
    daemon = ctx.socket(zmq.ROUTER)
    daemon.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/daemon"
    daemon.bind(endpoint)
    huge = GenParams(prompt="x" * (5 << 20))
    try:
        with anyio.fail_after(5):
            async with AsyncClient(endpoint) as client:
                with pytest.raises(Rejection) as refused:
                    await client.submit(huge, timeout_s=30)
            with Client(endpoint) as blocking, pytest.raises(Rejection) as refused_too:
                blocking.submit(GenParams(prompt="p", steps=0), timeout_s=30)
        assert refused.value.reason == Reason.INVALID and "$.params.prompt" in refused.value.rejected.message
        assert refused_too.value.reason == Reason.INVALID and "$.params.steps" in refused_too.value.rejected.message
        assert refused.value.rejected.message.startswith("not sent")
        assert await daemon.poll(100) == 0
    finally:
        daemon.close(linger=0)


async def test_an_unreadable_reply_fails_its_own_request_only(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """A Result whose frames are not its tensors is a Rejected for that request; a reply no
    request can be told of is dropped; the requests around them carry on."""
    daemon = ctx.socket(zmq.ROUTER)
    daemon.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/daemon"
    daemon.bind(endpoint)
    image = TensorSpec(name="image", dtype="uint8", shape=(2, 2), nbytes=4)
    try:
        with anyio.fail_after(10):
            async with AsyncClient(endpoint) as client, anyio.create_task_group() as tg:

                async def answer_both() -> None:
                    submits = {}
                    for _ in range(2):
                        identity, empty, body = await daemon.recv_multipart()
                        submits[CLIENT_REQUEST.decode(body).request_id] = identity
                    await daemon.send_multipart([submits["bad"], b"", encode(Result(
                        request_id="bad", outputs=[image], stages=[], total_ms=1.0)), b"abc"])
                    await daemon.send_multipart([submits["good"], b"", b"\xc1 not a reply"])
                    await daemon.send_multipart([submits["good"], b"", encode(Result(
                        request_id="good", outputs=[image], stages=[], total_ms=1.0)), b"abcd"])

                tg.start_soon(answer_both)
                outcomes: dict[str, object] = {}

                async def submit(rid: str) -> None:
                    try:
                        outcomes[rid] = await client.submit(PARAMS, request_id=rid, timeout_s=5)
                    except Rejection as exc:
                        outcomes[rid] = exc.rejected

                tg.start_soon(submit, "bad")
                tg.start_soon(submit, "good")
        bad, good = outcomes["bad"], outcomes["good"]
        assert isinstance(bad, Rejected) and bad.reason == Reason.INVALID
        assert "frame has 3 bytes, header needs 4" in bad.message
        assert isinstance(good, Generation) and good.outputs["image"].flatten().tolist() == list(b"abcd")
    finally:
        daemon.close(linger=0)
