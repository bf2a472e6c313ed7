"""TransferNegotiator: a worker's step reports reach the tracker only from the computing instance."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import zmq
import zmq.asyncio

from actors.mail import Enqueue, Placed, Send, Stepped
from tests.actors.negotiator_harness import (
    MANIFEST,
    NBYTES,
    PARAMS,
    fake_worker,
    job,
    running_negotiator,
    wait_late,
)
from transfer.protocol import Staged, Step, Work


async def test_steps_of_a_request_that_asked_reach_the_tracker_and_the_flag_follows_it(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path) as n, fake_worker(ctx, n, "encoder") as encoder, \
                fake_worker(ctx, n, "denoiser", slots=0) as stranger:
            watched = msgspec.structs.replace(job("r1", "encoder"), progress=True)
            n.inbox.post(Placed(job=watched, instance=encoder.instance))
            assert await n.pools["encoder"].receive() == Send(
                instance=encoder.instance, order=Work(request_id="r1", params=PARAMS, progress=True))

            await encoder.report(Step(request_id="r1", step=3, steps=8))
            assert await n.tracker.receive() == Stepped(request_id="r1", step=3, steps=8)
            await stranger.report(Step(request_id="r1", step=4, steps=8))  # not its request
            await encoder.report(Step(request_id="nobody", step=1, steps=8))  # no such request
            assert (await wait_late(n, 2)).late_reports == 2
            n.assert_silent()

            await encoder.report(Staged(request_id="r1", nbytes=NBYTES, manifest=MANIFEST, compute_ms=1.0))
            queued = await n.admission.receive()
            assert queued == Enqueue(job=msgspec.structs.replace(job("r1", "denoiser"), progress=True))
            await encoder.report(Step(request_id="r1", step=8, steps=8))  # the stage already staged
            assert (await wait_late(n, 3)).late_reports == 3
            n.assert_silent()
