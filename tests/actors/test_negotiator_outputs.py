"""TransferNegotiator and a decoder's output connection (protocol.md §3.2): its routing id
is the decoder's key, and it carries outputs and the decoder's last words, nothing else."""

from __future__ import annotations

import secrets
from pathlib import Path

import anyio
import zmq
import zmq.asyncio

from actors.mail import Finished, Leave
from tests.actors.negotiator_harness import IMAGE, connection, decoding, output, released
from transfer.protocol import (
    DAEMON_TO_WORKER,
    Leaving,
    Reason,
    RegisterRefused,
    Step,
    encode,
)


async def test_an_output_on_the_decoders_output_connection_finishes_its_request(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with decoding(ctx, tmp_path, "r1") as (n, decoder), connection(ctx, n, decoder.key) as outputs:
            await outputs.send_multipart(output("r1"))
            finished = await n.tracker.receive()
            assert isinstance(finished, Finished) and finished.instance == decoder.instance
            assert finished.outputs == [IMAGE] and bytes(finished.frames[0].buffer) == bytes(range(12))
            assert n.take("decoder") == [released("r1", decoder, ok=True)]


async def test_an_output_connection_under_any_other_routing_id_is_a_stranger(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Only the decoder knows its key: an output from anyone else finishes nothing."""
    with anyio.fail_after(5):
        async with decoding(ctx, tmp_path, "r1") as (n, decoder), \
                connection(ctx, n, secrets.token_bytes(16)) as stranger:
            await stranger.send_multipart(output("r1"))
            refused = DAEMON_TO_WORKER.decode(await stranger.recv())
            assert isinstance(refused, RegisterRefused) and refused.message.startswith("not registered")
            n.assert_silent()
            await decoder.sock.send_multipart(output("r1"))  # the decoder's own, on its main connection
            assert isinstance(await n.tracker.receive(), Finished)


async def test_leaving_on_the_output_connection_evicts_the_decoder_after_its_outputs(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Last words follow the outputs on their connection, so they never overtake one, and
    are answered there: the decoder waits for that answer before it exits."""
    with anyio.fail_after(5):
        async with decoding(ctx, tmp_path, "r1") as (n, decoder), connection(ctx, n, decoder.key) as outputs:
            await outputs.send_multipart(output("r1"))
            await outputs.send(encode(Leaving()))
            answer = DAEMON_TO_WORKER.decode(await outputs.recv())
            assert answer == RegisterRefused(message=f"{decoder.instance} left")
            assert isinstance(await n.tracker.receive(), Finished)
            leave = [m for m in n.take("decoder") if isinstance(m, Leave)]
            while not leave:
                leave = [m for m in [await n.pools["decoder"].receive()] if isinstance(m, Leave)]
            assert leave[0].instance == decoder.instance
            assert decoder.instance not in (await n.stats()).prealloc


async def test_a_report_on_the_output_connection_gets_the_decoder_dropped(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """It carries outputs and Leaving only: a worker that sends anything else there is
    broken, and is evicted as one sending garbled reports is, and told why."""
    with anyio.fail_after(5):
        async with decoding(ctx, tmp_path, "r1") as (n, decoder), connection(ctx, n, decoder.key) as outputs:
            await outputs.send(encode(Step(request_id="r1", step=1, steps=2)))
            refused = DAEMON_TO_WORKER.decode(await decoder.sock.recv())
            assert isinstance(refused, RegisterRefused) and not refused.rejoin
            assert refused.message == (f"{decoder.instance} sent a report the daemon cannot read: a Step on its "
                                       "output connection, which carries outputs and Leaving only")
            failed = [m for m in n.take("tracker") if m.request_id == "r1"]
            assert failed and failed[0].reason == Reason.WORKER_LOST
            await outputs.send_multipart(output("r1"))  # the key died with the link
            assert isinstance(DAEMON_TO_WORKER.decode(await outputs.recv()), RegisterRefused)
            assert decoder.instance not in (await n.stats()).prealloc
