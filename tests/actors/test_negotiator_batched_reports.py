"""TransferNegotiator: several reports in one worker-socket message (protocol.md §3.2)."""

from __future__ import annotations

from pathlib import Path

import anyio
import zmq
import zmq.asyncio

from actors.mail import Enqueue, Failed, Placed, Send
from tests.actors.negotiator_harness import MANIFEST, NBYTES, PARAMS, fake_worker, job, running_negotiator
from transfer.protocol import Done, Reason, Staged, Work, encode


async def test_every_report_in_a_message_is_handled_in_order_and_a_bad_one_is_skipped(
    ctx: zmq.asyncio.Context, tmp_path: Path, logs: list[dict]
) -> None:
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path) as n, fake_worker(ctx, n, "encoder") as encoder:
            for rid in ("r1", "r2", "r3"):
                n.inbox.post(Placed(job=job(rid, "encoder"), instance=encoder.instance))
                assert await n.pools["encoder"].receive() == Send(instance=encoder.instance,
                                                                  order=Work(request_id=rid, params=PARAMS))
            # A failure Done declares no outputs, so the reports after it are still reports.
            await encoder.sock.send_multipart([
                encode(Done(request_id="r1", ok=False, compute_ms=1.0, error="oom")),
                encode(Staged(request_id="r2", nbytes=NBYTES, manifest=MANIFEST, compute_ms=1.0)),
                b"\xc1 not msgpack",
                encode(Staged(request_id="r3", nbytes=NBYTES, manifest=MANIFEST, compute_ms=1.0)),
            ])
            assert await n.tracker.receive() == Failed(request_id="r1", reason=Reason.STAGE_FAILED,
                                                       message=f"{encoder.instance}: oom",
                                                       avoid=frozenset({encoder.instance}))
            assert [await n.admission.receive() for _ in range(2)] == [
                Enqueue(job=job("r2", "denoiser")), Enqueue(job=job("r3", "denoiser"))]
            assert [entry["event"] for entry in logs].count("worker.bad_message") == 1

