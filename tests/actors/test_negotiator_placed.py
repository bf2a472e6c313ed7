"""TransferNegotiator: a slot reserved for a request that has already ended goes back to its pool.

The race: the worker's ``Staged`` reaches the negotiator (which enqueues the denoiser job)
just as the request fails. Admission handles the ``Forget`` first and passes it to every
pool, so it reaches the denoiser pool while the request holds nothing there and is not
forwarded; then admission dispatches the (now stale) denoiser job. The pool reserves a slot
and reports ``Placed``; the negotiator, whose flight the encoder pool's ``Forget`` already
ended, is the only actor that can see the slot is orphaned. It hands the slot back with
``Release(ok=None)`` (unused: counted neither served nor failed), never with a ``Forget``,
which the pool would pass on and which could end a newer request reusing the id.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from pathlib import Path

import anyio
import zmq.asyncio

from actors.base import ask_stats
from actors.mail import Job, Placed, Release
from actors.mailbox import Switchboard
from actors.negotiator import TransferNegotiator
from orchestrator.config import DaemonConfig
from tests.actors.streams import assert_empty, open_stream
from transfer.protocol import ROLES, GenParams


async def test_placed_for_an_ended_request_frees_the_reserved_slot(tmp_path: Path) -> None:
    ctx = zmq.asyncio.Context()
    try:
        with anyio.fail_after(5), ExitStack() as stack:
            board = Switchboard()
            inbox = board.mailbox("negotiator", 32)
            streams = {name: open_stream(stack, board, name) for name in ("admission", "tracker", "frontend", *ROLES)}
            negotiator = TransferNegotiator(
                inbox,
                ctx=ctx,
                cfg=DaemonConfig(worker_endpoint=f"ipc://{tmp_path}/workers"),
                pools={role: streams[role][0] for role in ROLES},
                admission=streams["admission"][0],
                tracker=streams["tracker"][0],
                frontend=streams["frontend"][0],
            )
            async with anyio.create_task_group() as tg:
                await tg.start(negotiator.run)
                job = Job(request_id="ended", role="denoiser", params=GenParams(prompt="p"), deadline=math.inf)
                inbox.post(Placed(job=job, instance="denoiser-1"))
                await ask_stats(inbox)  # the Placed was handled
                tg.cancel_scope.cancel()
            assert streams["denoiser"][1].receive_nowait() == Release(request_id="ended", instance="denoiser-1",
                                                                      ok=None)
            assert_empty(**{name: rx for name, (_, rx) in streams.items()})
    finally:
        ctx.destroy(linger=0)
