"""TransferNegotiator and a decoder told to stop: Stopping at once, its output handed over,
then Leaving, answered on the output connection."""

from __future__ import annotations

from pathlib import Path

import anyio
import zmq
import zmq.asyncio

from actors.mail import Finished, Leave, Suspect
from tests.actors.negotiator_harness import connection, decoding, output, speak
from transfer.protocol import DAEMON_TO_WORKER, Heartbeat, Leaving, RegisterRefused, Stopping, encode


async def test_a_stopping_decoder_gets_no_new_work_and_still_finishes_what_it_holds(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with decoding(ctx, tmp_path, "r1") as (n, decoder), connection(ctx, n, decoder.key) as outputs:
            await decoder.report(Stopping())
            assert await n.pools["decoder"].receive() == Suspect(instance=decoder.instance, suspect=True)
            await decoder.report(Heartbeat())  # alive, but that takes back nothing
            await speak(n, decoder)
            n.assert_silent()
            await outputs.send_multipart(output("r1"))
            await outputs.send(encode(Leaving()))
            assert DAEMON_TO_WORKER.decode(await outputs.recv()) == RegisterRefused(message=f"{decoder.instance} left")
            assert isinstance(await n.tracker.receive(), Finished)  # its request ended there, not again elsewhere
            posted = n.take("decoder")
            assert [type(m) for m in posted][-1] is Leave and not any(isinstance(m, Suspect) for m in posted)
