"""The benchmark's instant workers answer each order as a real worker with a zero-time stage does."""

from __future__ import annotations

from orchestrator.instant_workers import InstantWorker
from transfer.protocol import WORKER_MESSAGE, Abort, Stopped


def test_an_abort_asking_for_an_ack_gets_it_at_once_and_a_plain_one_gets_nothing() -> None:
    # Nothing runs on an instant worker, so the run an Abort stops is always over; without
    # the answer the daemon would hold that slot for good.
    worker = InstantWorker("decoder", dealer=None, work=None, key=b"", pool_base=0, outputs=None)  # type: ignore[arg-type]
    answer = worker.answer(Abort(request_id="r1", ack=3))
    assert answer is not None and WORKER_MESSAGE.decode(answer[0]) == Stopped(request_id="r1", ack=3)
    assert worker.answer(Abort(request_id="r1")) is None
