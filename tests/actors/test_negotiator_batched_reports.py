"""TransferNegotiator: several reports in one worker-socket message (protocol.md §3.2)."""

from __future__ import annotations

from pathlib import Path

import anyio
import zmq
import zmq.asyncio

from actors.mail import Enqueue, Failed, Leave, Placed, Send
from tests.actors.negotiator_harness import MANIFEST, NBYTES, PARAMS, fake_worker, job, running_negotiator
from transfer.protocol import DAEMON_TO_WORKER, Done, Reason, RegisterRefused, Staged, Work, encode


async def test_every_report_in_a_message_is_handled_in_order_and_a_bad_one_drops_its_sender(
    ctx: zmq.asyncio.Context, tmp_path: Path, logs: list[dict]
) -> None:
    """What an unreadable report said is unknown (a stage's end? a push's?): rather than leave
    the requests its worker holds to their deadlines, the worker is evicted as a lost one is
    (its requests retried elsewhere) and told why, which ends it."""
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
                encode(Staged(request_id="r3", nbytes=NBYTES, manifest=MANIFEST, compute_ms=float("nan"))),
                encode(Staged(request_id="r4", nbytes=NBYTES, manifest=MANIFEST, compute_ms=1.0)),
            ])
            refused = DAEMON_TO_WORKER.decode(await encoder.sock.recv())
            assert isinstance(refused, RegisterRefused) and not refused.rejoin
            assert refused.message.startswith(f"{encoder.instance} sent a report the daemon cannot read: ")
            assert "$.compute_ms" in refused.message
            await n.stats()
            assert n.take("tracker") == [
                Failed(request_id="r1", reason=Reason.STAGE_FAILED, message=f"{encoder.instance}: oom",
                       avoid=frozenset({encoder.instance})),
                *(Failed(request_id=rid, reason=Reason.WORKER_LOST, message=refused.message,
                         avoid=frozenset({encoder.instance})) for rid in ("r2", "r3")),
            ]
            # r2 was handed on before the bad report; the report after it is about nothing.
            assert n.take("admission") == [Enqueue(job=job("r2", "denoiser"))]
            assert Leave(instance=encoder.instance,
                         message=refused.message) in n.take("encoder")
            assert [entry["event"] for entry in logs].count("worker.bad_message") == 1
            stats = await n.stats()
            assert stats.handoffs_in_flight == 0 and encoder.instance not in stats.limits
