"""TransferNegotiator: a sender learns the receiver's shared pool only when both share a host,
and the tracker hears how the bytes moved."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import zmq
import zmq.asyncio

from actors.mail import HandedOff, Placed
from tests.actors.negotiator_harness import (
    NBYTES,
    POOL_BASE,
    fake_worker,
    job,
    running_negotiator,
    shared_pool,
    stage_encoder_output,
)
from transfer.protocol import Push, Pushed


@pytest.mark.parametrize(("sender_host", "receiver_host", "shared"), [
    ("host-a", "host-a", True),
    ("host-a", "host-b", False),  # another kernel: its memory is not ours to map
    (None, "host-a", False),  # a sender without shared memory (same_host_copy off)
    ("host-a", None, False),
])
async def test_push_names_the_receivers_shared_pool_only_on_one_host(
    ctx: zmq.asyncio.Context, tmp_path: Path, sender_host: str | None, receiver_host: str | None, shared: bool
) -> None:
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path) as n, \
                fake_worker(ctx, n, "encoder", host=sender_host) as encoder, \
                fake_worker(ctx, n, "denoiser", slots=1, host=receiver_host) as denoiser:
            await stage_encoder_output(n, encoder, "r1")
            n.inbox.post(Placed(job=job("r1", "denoiser"), instance=denoiser.instance))
            push = (await n.pools["encoder"].receive()).order
            assert push == Push(request_id="r1", session=denoiser.session, address=POOL_BASE, nbytes=NBYTES,
                                local=shared_pool("host-a", "denoiser") if shared else None)

            via = "memcpy" if shared else "mooncake"
            await encoder.report(Pushed(request_id="r1", ok=True, transfer_ms=0.1, via=via))
            handed = await n.tracker.receive()
            assert isinstance(handed, HandedOff) and handed.via == via
