"""TransferNegotiator: a slot reserved for a request that has already ended goes back to its pool.

The race: the tracker's ``Forget`` reaches the denoiser pool while the request holds nothing
there, and only afterwards does admission dispatch the request's (now stale) denoiser job,
because the worker's ``Staged`` reached the negotiator before the forwarded ``Forget`` did,
or a ``Credit`` was handled before the ``Withdraw``. The pool reserves a slot and reports
``Placed``; the negotiator, finding no flight, is the only actor that can see the slot is
orphaned.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.mail import Forget, Job, Placed, QueryStats, Release
from actors.negotiator import TransferNegotiator
from orchestrator.config import DaemonConfig
from transfer.protocol import ROLES, GenParams


async def test_placed_for_an_ended_request_frees_the_reserved_slot(tmp_path: Path) -> None:
    ctx = zmq.asyncio.Context()
    try:
        with anyio.fail_after(5):
            streams: dict[str, tuple[MemoryObjectSendStream[Any], MemoryObjectReceiveStream[Any]]] = {
                name: anyio.create_memory_object_stream[Any](32)
                for name in ("inbox", "admission", "tracker", "frontend", *ROLES)
            }
            try:
                inbox, _ = streams["inbox"]
                negotiator = TransferNegotiator(
                    streams["inbox"][1],
                    ctx=ctx,
                    cfg=DaemonConfig(worker_endpoint=f"ipc://{tmp_path}/workers"),
                    pools={role: streams[role][0] for role in ROLES},
                    admission=streams["admission"][0],
                    tracker=streams["tracker"][0],
                    frontend=streams["frontend"][0],
                )
                async with anyio.create_task_group() as tg:
                    await tg.start(negotiator.run)
                    job = Job(request_id="ended", role="denoiser", params=GenParams(prompt="p"))
                    await inbox.send(Placed(job=job, instance="denoiser-1"))
                    reply_tx, reply_rx = anyio.create_memory_object_stream[Any](1)
                    with reply_rx:
                        await inbox.send(QueryStats(reply=reply_tx))
                        await reply_rx.receive()  # the Placed was handled
                    inbox.close()
                freed = streams["denoiser"][1].receive_nowait()
                assert freed in (Forget(request_id="ended"),
                                 Release(request_id="ended", instance="denoiser-1", ok=False))
            finally:
                for tx, rx in streams.values():
                    tx.close()
                    rx.close()
    finally:
        ctx.destroy(linger=0)
