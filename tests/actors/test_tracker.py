"""TrackerActor with fake peers: every request ends exactly once, and late news changes nothing."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream

from actors.base import ask_stats
from actors.mail import (
    Admit,
    CancelRequest,
    Deliver,
    Enqueue,
    Failed,
    Finished,
    Forget,
    HandedOff,
    Job,
    Queued,
    StartDrain,
    Stepped,
    Tick,
    TrackerMail,
)
from actors.mailbox import Mailbox, Switchboard
from actors.tracker import MIN_STEP_GAP_S, TrackerActor, TrackerStats
from tests.actors.streams import assert_empty, open_stream, queued
from transfer.protocol import GenParams, Progress, Reason, Rejected, Result, Role, TensorSpec

PARAMS = GenParams(prompt="a cat")
OUTPUTS = [TensorSpec(name="image_0.png", dtype="uint8", shape=(3,), nbytes=3)]
TINY_TIMEOUT_S = 0.01


@dataclass
class Tracker:
    """The actor's inbox, and the receive ends of everything it posts to (it knows no pools)."""

    inbox: Mailbox[TrackerMail]
    frontend: MemoryObjectReceiveStream[Any]
    admission: MemoryObjectReceiveStream[Any]

    async def stats(self) -> TrackerStats:
        """Ask for stats; the answer also proves every earlier mail was handled."""
        return await ask_stats(self.inbox)

    def assert_silent(self) -> None:
        assert_empty(frontend=self.frontend, admission=self.admission)


@asynccontextmanager
async def running_tracker() -> AsyncIterator[Tracker]:
    async with AsyncExitStack() as stack:

        board = Switchboard()
        inbox = board.mailbox("tracker", 32)
        fe_box, fe_rx = open_stream(stack, board, "frontend")
        ad_box, ad_rx = open_stream(stack, board, "admission")
        actor = TrackerActor(inbox, frontend=fe_box, admission=ad_box)
        async with anyio.create_task_group() as tg:
            await tg.start(actor.run)
            yield Tracker(inbox, fe_rx, ad_rx)
            tg.cancel_scope.cancel()  # the actor's run is cancelled


async def admit(t: Tracker, rid: str = "r1", timeout_s: float = 60.0) -> None:
    since = time.monotonic()
    t.inbox.post(Admit(request_id=rid, params=PARAMS, timeout_s=timeout_s, submitted_at=since))
    await assert_encoder_job(t, rid, since=since, timeout_s=timeout_s)


async def assert_encoder_job(t: Tracker, rid: str, *, since: float, timeout_s: float = 60.0, **fields: Any) -> None:
    """The next mail to admission queues ``rid`` for an encoder, with ``fields`` and the
    request's deadline: ``timeout_s`` after its admission, which came after ``since``."""
    mail = await t.admission.receive()
    assert isinstance(mail, Enqueue), mail
    deadline = mail.job.deadline
    assert since + timeout_s <= deadline <= time.monotonic() + timeout_s
    assert mail == Enqueue(job=Job(request_id=rid, role="encoder", params=PARAMS, deadline=deadline, **fields))


def handed_off(rid: str, role: Role, **overrides: Any) -> HandedOff:
    fields = {"request_id": rid, "role": role, "instance": f"{role}-1", "compute_ms": 1.0, "transfer_ms": 0.5,
              "nbytes": 1024, "fast_path": True}
    return HandedOff(**(fields | overrides))


def finished(rid: str) -> Finished:
    return Finished(request_id=rid, instance="decoder-1", compute_ms=2.0, outputs=OUTPUTS, frames=[b"abc"])


async def run_to_decoding(t: Tracker, rid: str = "r1") -> None:
    await admit(t, rid)
    t.inbox.post(handed_off(rid, "encoder", fast_path=True))
    t.inbox.post(handed_off(rid, "denoiser", fast_path=False, nbytes=4096))


async def tick_until_delivered(t: Tracker) -> Deliver:
    """Tick until a deadline passes. Deadlines are wall-clock, so this polls (bounded by fail_after)."""
    while True:
        t.inbox.post(Tick())
        await t.stats()
        try:
            return t.frontend.receive_nowait()
        except anyio.WouldBlock:
            await anyio.sleep(TINY_TIMEOUT_S / 2)


async def assert_forgotten(t: Tracker, rid: str) -> None:
    """One Forget, to admission only: admission passes it on to the pools, they to the negotiator."""
    assert await t.admission.receive() == Forget(request_id=rid)
    await t.stats()
    t.assert_silent()


# --------------------------------------------------------------------------- the happy path


async def test_admit_queues_the_request_for_an_encoder() -> None:
    with anyio.fail_after(5):
        async with running_tracker() as t:
            since = time.monotonic()
            t.inbox.post(Admit(request_id="r1", params=PARAMS, timeout_s=60.0, submitted_at=since))
            await assert_encoder_job(t, "r1", since=since)


async def test_a_retry_goes_before_the_jobs_of_its_priority_that_had_no_turn() -> None:
    """It waited its turn once already: queued behind everything again, it would spend what
    is left of its deadline there."""
    with anyio.fail_after(5):
        async with running_tracker() as t:
            for rid, again in (("new", False), ("retried", True)):
                t.inbox.post(Admit(request_id=rid, params=PARAMS, timeout_s=60.0, submitted_at=time.monotonic(),
                                   again=again))
                mail = await t.admission.receive()
                assert isinstance(mail, Enqueue) and (mail.job.request_id, mail.job.again) == (rid, again)


async def test_full_journey_delivers_a_result_with_three_stage_timings() -> None:
    with anyio.fail_after(5):
        async with running_tracker() as t:
            await run_to_decoding(t)
            await anyio.sleep(0.05)  # the decoder's stage: 2 ms of compute in 50 ms of wall
            t.inbox.post(finished("r1"))
            deliver = await t.frontend.receive()
            assert isinstance(deliver, Deliver) and deliver.request_id == "r1"
            assert list(deliver.frames) == [b"abc"]
            result = deliver.message
            assert isinstance(result, Result)
            assert result.outputs == OUTPUTS
            assert [(s.role, s.instance, s.fast_path) for s in result.stages] == [
                ("encoder", "encoder-1", True),
                ("denoiser", "denoiser-1", False),
                ("decoder", "decoder-1", None),
            ]
            assert [s.transfer_bytes for s in result.stages] == [1024, 4096, 0]
            assert all(s.queued_ms >= 0 for s in result.stages)
            # Queued: the stage's wall time less its compute and transfer.
            assert 45 <= result.stages[2].queued_ms <= 1000
            assert result.total_ms >= 50


async def test_a_wait_for_the_next_roles_slot_is_that_roles_queueing() -> None:
    """The encoder's output waited 300 ms for a denoiser: the denoiser was the bottleneck,
    so its stage, not the encoder's, shows the wait; and so on down the line."""
    with anyio.fail_after(5):
        async with running_tracker() as t:
            await admit(t, "r1")
            await anyio.sleep(0.35)  # the encoder's stage: 1 + 0.5 ms of work, 300 ms of it waiting
            t.inbox.post(handed_off("r1", "encoder", waited_ms=300.0))
            await t.stats()
            await anyio.sleep(0.05)
            t.inbox.post(handed_off("r1", "denoiser", waited_ms=40.0))
            t.inbox.post(finished("r1"))
            result = (await t.frontend.receive()).message
            encoder, denoiser, decoder = (s.queued_ms for s in result.stages)
            assert encoder < 100  # 350 ms of wall less the 300 ms spent waiting for a denoiser
            assert 300 <= denoiser < 320  # its own 10 ms of queueing, and the encoder's wait
            assert 40 <= decoder < 60


async def test_completed_request_is_counted_and_leaves_the_table() -> None:
    with anyio.fail_after(5):
        async with running_tracker() as t:
            await run_to_decoding(t)
            assert (await t.stats()).by_state == {"decoding": 1}
            t.inbox.post(finished("r1"))
            await t.frontend.receive()
            stats = await t.stats()
            assert (stats.completed, stats.by_state, stats.failed_by_reason) == (1, {}, {})
            # Its times went into the latency book: the request, and each stage and hop of it.
            assert {key: sum(lat.counts) for key, lat in stats.latency.items()} == dict.fromkeys(
                ["encoder.queued", "encoder.compute", "encoder->denoiser", "denoiser.queued", "denoiser.compute",
                 "denoiser->decoder", "decoder.queued", "decoder.compute", "request"], 1)
            assert stats.latency["decoder.compute"].total_ms == 2.0
            assert stats.handoff_bytes == {"encoder->denoiser": 1024, "denoiser->decoder": 4096}


async def test_request_done_is_logged_once_with_its_stages(logs: list[dict[str, Any]]) -> None:
    with anyio.fail_after(5):
        async with running_tracker() as t:
            await run_to_decoding(t)
            t.inbox.post(finished("r1"))
            await t.frontend.receive()
        done = [entry for entry in logs if entry["event"] == "request.done"]
        assert len(done) == 1
        assert done[0]["request_id"] == "r1" and len(done[0]["stages"]) == 3


async def test_failure_is_logged_with_its_reason(logs: list[dict[str, Any]]) -> None:
    with anyio.fail_after(5):
        async with running_tracker() as t:
            await admit(t)
            t.inbox.post(CancelRequest(request_id="r1"))
            await t.frontend.receive()
        assert {"event": "request.failed", "request_id": "r1", "reason": "cancelled", "actor": "tracker",
                "message": "cancelled by the client", "state": "encoding", "log_level": "warning"} in logs


async def test_hand_off_from_the_wrong_stage_is_ignored() -> None:
    """A denoiser hand-off for a request still encoding is stale news, not a transition."""
    with anyio.fail_after(5):
        async with running_tracker() as t:
            await admit(t)
            t.inbox.post(handed_off("r1", "denoiser"))
            assert (await t.stats()).by_state == {"encoding": 1}
            t.inbox.post(finished("r1"))
            assert (await t.stats()).by_state == {"encoding": 1}
            t.assert_silent()


# --------------------------------------------------------------------------- deadlines


async def test_deadline_rejects_with_timed_out() -> None:
    with anyio.fail_after(5):
        async with running_tracker() as t:
            await admit(t, timeout_s=TINY_TIMEOUT_S)
            deliver = await tick_until_delivered(t)
            assert deliver.request_id == "r1"
            assert isinstance(deliver.message, Rejected)
            assert deliver.message.reason == Reason.TIMED_OUT
            # Encoding lasts until the hand-off to a denoiser: the message says all it may be.
            assert deliver.message.message == ("deadline passed while queued for an encoder, encoding, or its "
                                               "embeddings waiting for a denoiser")


async def test_deadline_sends_one_forget_to_admission() -> None:
    with anyio.fail_after(5):
        async with running_tracker() as t:
            await admit(t, timeout_s=TINY_TIMEOUT_S)
            await tick_until_delivered(t)
            await assert_forgotten(t, "r1")
            assert (await t.stats()).failed_by_reason == {"timed_out": 1}


async def test_news_after_the_deadline_changes_nothing() -> None:
    with anyio.fail_after(5):
        async with running_tracker() as t:
            await admit(t, timeout_s=TINY_TIMEOUT_S)
            await tick_until_delivered(t)
            await assert_forgotten(t, "r1")
            t.inbox.post(handed_off("r1", "encoder"))
            t.inbox.post(finished("r1"))
            t.inbox.post(Failed(request_id="r1", reason=Reason.STAGE_FAILED, message="late"))
            stats = await t.stats()
            t.assert_silent()
            assert (stats.completed, stats.by_state, stats.failed_by_reason) == (0, {}, {"timed_out": 1})


async def test_tick_expires_only_requests_past_their_deadline() -> None:
    with anyio.fail_after(5):
        async with running_tracker() as t:
            await admit(t, "patient", timeout_s=60.0)
            await admit(t, "hasty", timeout_s=TINY_TIMEOUT_S)
            deliver = await tick_until_delivered(t)
            assert deliver.request_id == "hasty"
            assert (await t.stats()).by_state == {"encoding": 1}


async def past_deadline(t: Tracker, rid: str) -> None:
    """Admit ``rid`` with a tiny timeout and return once its deadline has passed."""
    t.inbox.post(Admit(request_id=rid, params=PARAMS, timeout_s=TINY_TIMEOUT_S, submitted_at=time.monotonic()))
    deadline = (await t.admission.receive()).job.deadline
    await anyio.sleep(deadline - time.monotonic() + TINY_TIMEOUT_S)


async def test_the_first_tick_past_a_deadline_expires_its_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ticks come every tick_s, a fraction of a second: a request is timed out at the first
    one after its deadline, not at one some slack later (its client waits that long). The
    tracker's clock is set by hand, so a slow machine cannot blur "just after"."""
    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr("actors.tracker.time", SimpleNamespace(monotonic=lambda: clock.now))
    with anyio.fail_after(5):
        async with running_tracker() as t:
            t.inbox.post(Admit(request_id="r1", params=PARAMS, timeout_s=1.0, submitted_at=clock.now))
            assert (await t.admission.receive()).job.deadline == 1001.0
            clock.now = 1001.0
            t.inbox.post(Tick())
            await t.stats()
            deliver = t.frontend.receive_nowait()
            assert isinstance(deliver.message, Rejected) and deliver.message.reason == Reason.TIMED_OUT


async def test_deadlines_of_live_requests_outlast_the_rebuild_of_the_heap() -> None:
    """Ended requests leave their deadlines in the heap until over 1,024 pile up and it is
    rebuilt from the table. Both live requests, the one admitted before the 1,100 that ended
    and the one whose admission set the rebuild off, must keep their deadlines through it:
    one dropped would never time out, and its client would wait forever."""
    with anyio.fail_after(5):
        async with running_tracker() as t:
            # No Tick until the end, so the early one's deadline may pass meanwhile.
            t.inbox.post(Admit(request_id="early", params=PARAMS, timeout_s=TINY_TIMEOUT_S,
                               submitted_at=time.monotonic()))
            t.admission.receive_nowait()
            ended = [f"r{i}" for i in range(1100)]
            for rid in ended:  # all live at once: the heap is not rebuilt while they are
                t.inbox.post(Admit(request_id=rid, params=PARAMS, timeout_s=60.0, submitted_at=time.monotonic()))
                t.admission.receive_nowait()
            for rid in ended:
                t.inbox.post(CancelRequest(request_id=rid))
                t.frontend.receive_nowait()
                assert t.admission.receive_nowait() == Forget(request_id=rid)
            await past_deadline(t, "late")  # 1,102 deadlines for 2 live requests: rebuilt
            t.inbox.post(Tick())
            stats = await t.stats()
            assert [(d.request_id, d.message.reason) for d in queued(t.frontend)] == [("early", Reason.TIMED_OUT),
                                                                                     ("late", Reason.TIMED_OUT)]
            assert stats.by_state == {}


# --------------------------------------------------------------------------- failures and cancels


async def test_a_retry_carries_what_to_avoid_and_a_failure_says_what_it_implicates() -> None:
    """The frontend's retry names the instances to avoid; the tracker passes them to the
    encoder's job, and a failure's implicated instances back to the frontend."""
    with anyio.fail_after(5):
        async with running_tracker() as t:
            avoid = frozenset({"encoder-1", "denoiser-2"})
            since = time.monotonic()
            t.inbox.post(Admit(request_id="r1", params=PARAMS, timeout_s=60.0, submitted_at=since, avoid=avoid))
            await assert_encoder_job(t, "r1", since=since, avoid=avoid)
            t.inbox.post(Failed(request_id="r1", reason=Reason.TRANSFER_FAILED, message="x",
                                avoid=frozenset({"encoder-1"})))
            assert (await t.frontend.receive()).avoid == {"encoder-1"}


async def test_failure_reported_twice_rejects_once() -> None:
    with anyio.fail_after(5):
        async with running_tracker() as t:
            await admit(t)
            t.inbox.post(Failed(request_id="r1", reason=Reason.WORKER_LOST, message="gone"))
            t.inbox.post(Failed(request_id="r1", reason=Reason.STAGE_FAILED, message="also"))
            deliver = await t.frontend.receive()
            assert deliver.message == Rejected(request_id="r1", reason=Reason.WORKER_LOST, message="gone")
            await assert_forgotten(t, "r1")
            assert (await t.stats()).failed_by_reason == {"worker_lost": 1}
            t.assert_silent()


async def test_cancel_rejects_with_cancelled() -> None:
    with anyio.fail_after(5):
        async with running_tracker() as t:
            await run_to_decoding(t)
            t.inbox.post(CancelRequest(request_id="r1"))
            deliver = await t.frontend.receive()
            assert isinstance(deliver.message, Rejected)
            assert deliver.message.reason == Reason.CANCELLED
            await assert_forgotten(t, "r1")


@pytest.mark.parametrize("reason", [Reason.WORKER_LOST, Reason.TRANSFER_FAILED])
async def test_a_cancel_that_crossed_a_retriable_failure_is_counted_as_what_the_client_heard(reason: Reason) -> None:
    """The frontend cancelled first, so it answers the client `cancelled` and retries
    nothing: the failure was counted as worker_lost (say) and the client's cancel nowhere."""
    with anyio.fail_after(5):
        async with running_tracker() as t:
            await admit(t)
            t.inbox.post(Failed(request_id="r1", reason=reason, message="gone"))
            await t.frontend.receive()
            await assert_forgotten(t, "r1")
            t.inbox.post(CancelRequest(request_id="r1"))  # posted before the frontend heard of the failure
            assert (await t.stats()).failed_by_reason == {"cancelled": 1}
            t.inbox.post(CancelRequest(request_id="r1"))  # once
            await admit(t, "r2")
            t.inbox.post(Failed(request_id="r2", reason=Reason.STAGE_FAILED, message="broke"))
            await t.frontend.receive()
            await assert_forgotten(t, "r2")
            t.inbox.post(CancelRequest(request_id="r2"))  # the frontend answers stage_failed as it is
            assert (await t.stats()).failed_by_reason == {"cancelled": 1, "stage_failed": 1}
            t.assert_silent()


async def test_cancel_of_an_unknown_request_does_nothing() -> None:
    with anyio.fail_after(5):
        async with running_tracker() as t:
            t.inbox.post(CancelRequest(request_id="nobody"))
            await t.stats()
            t.assert_silent()


# --------------------------------------------------------------------------- drain


async def test_drain_with_nothing_in_flight_is_immediate() -> None:
    with anyio.fail_after(5):
        async with running_tracker() as t:
            drained = anyio.Event()
            t.inbox.post(StartDrain(drained=drained))
            await drained.wait()


async def test_drain_waits_for_the_table_to_empty() -> None:
    with anyio.fail_after(5):
        async with running_tracker() as t:
            await run_to_decoding(t, "done")
            await admit(t, "cancelled")
            drained = anyio.Event()
            t.inbox.post(StartDrain(drained=drained))
            t.inbox.post(finished("done"))
            await t.stats()
            assert not drained.is_set()
            t.inbox.post(CancelRequest(request_id="cancelled"))
            await drained.wait()


async def test_the_encoder_job_carries_the_requests_priority() -> None:
    with anyio.fail_after(5):
        async with running_tracker() as t:
            since = time.monotonic()
            t.inbox.post(Admit(request_id="r1", params=PARAMS, timeout_s=60.0, priority=-3, submitted_at=since))
            await assert_encoder_job(t, "r1", since=since, priority=-3)


# --------------------------------------------------------------------------- progress


async def test_a_request_that_asked_for_progress_hears_of_every_stage_and_step() -> None:
    with anyio.fail_after(5):
        async with running_tracker() as t:
            t.inbox.post(Admit(request_id="r1", params=PARAMS, timeout_s=60.0, progress=True,
                               submitted_at=time.monotonic()))
            job = (await t.admission.receive()).job
            assert job.progress  # carried to every stage's order

            def progress(mail: Deliver) -> tuple[str, str, int, int, int]:
                news = mail.message
                assert isinstance(news, Progress) and news.elapsed_ms >= 0
                return mail.request_id, news.state, news.step, news.steps, news.position

            assert progress(await t.frontend.receive()) == ("r1", "encoding", 0, 0, 0)
            t.inbox.post(Queued(request_id="r1", role="denoiser", position=2))  # staged, waiting for a denoiser
            assert progress(await t.frontend.receive()) == ("r1", "denoising", 0, 0, 2)
            t.inbox.post(handed_off("r1", "encoder"))
            assert progress(await t.frontend.receive()) == ("r1", "denoising", 0, 0, 0)
            t.inbox.post(Stepped(request_id="r1", step=4, steps=20))
            assert progress(await t.frontend.receive()) == ("r1", "denoising", 4, 20, 0)
            t.inbox.post(handed_off("r1", "denoiser"))
            assert progress(await t.frontend.receive()) == ("r1", "decoding", 0, 0, 0)
            t.inbox.post(finished("r1"))
            assert isinstance((await t.frontend.receive()).message, Result)
            t.inbox.post(Stepped(request_id="r1", step=5, steps=20))  # late: the request ended
            await t.stats()
            t.assert_silent()


async def test_progress_estimates_the_work_left_from_the_requests_before_and_its_own_steps() -> None:
    """Once one request went through (encode 1 + 0.5 ms, 20 steps in 1 ms, latents 0.5 ms,
    decode 2 ms), the next, alike, is told 5 ms at the start, then what each stage leaves."""
    with anyio.fail_after(5):
        async with running_tracker() as t:
            t.inbox.post(Admit(request_id="r0", params=PARAMS, timeout_s=60.0, progress=True,
                               submitted_at=time.monotonic()))
            await t.admission.receive()
            assert (await t.frontend.receive()).message.eta_ms is None  # nothing to go by yet
            t.inbox.post(handed_off("r0", "encoder"))
            t.inbox.post(handed_off("r0", "denoiser"))
            t.inbox.post(finished("r0"))
            while not isinstance((await t.frontend.receive()).message, Result):
                pass

            t.inbox.post(Admit(request_id="r1", params=PARAMS, timeout_s=60.0, progress=True,
                               submitted_at=time.monotonic()))
            await t.admission.receive()

            async def eta() -> float:
                news = (await t.frontend.receive()).message
                assert isinstance(news, Progress) and news.eta_ms is not None
                return news.eta_ms

            assert await eta() == pytest.approx(1.5 + 1.0 + 0.5 + 2.0)
            t.inbox.post(handed_off("r1", "encoder"))
            assert await eta() == pytest.approx(1.0 + 0.5 + 2.0)
            t.inbox.post(Stepped(request_id="r1", step=4, steps=20))
            assert await eta() == pytest.approx(16 * 0.05 + 0.5 + 2.0)
            await anyio.sleep(0.05)
            t.inbox.post(Stepped(request_id="r1", step=6, steps=20))  # its own pace: >= 25 ms a step
            assert 14 * 25 <= await eta() < 14 * 2500
            t.inbox.post(handed_off("r1", "denoiser"))
            assert await eta() == pytest.approx(2.0)  # the decode: what r0's took


async def test_a_request_that_did_not_ask_hears_only_its_answer() -> None:
    with anyio.fail_after(5):
        async with running_tracker() as t:
            await run_to_decoding(t)
            t.inbox.post(Stepped(request_id="r1", step=4, steps=20))
            t.inbox.post(Queued(request_id="r1", role="decoder", position=1))
            t.inbox.post(finished("r1"))
            assert isinstance((await t.frontend.receive()).message, Result)
            await t.stats()
            t.assert_silent()


async def test_a_retrys_times_count_from_the_clients_submit() -> None:
    """A retry is a new admission; its progress and its total_ms still count from the
    submit (Admit.submitted_at), not from the latest attempt."""
    with anyio.fail_after(5):
        async with running_tracker() as t:
            t.inbox.post(Admit(request_id="r1#1", params=PARAMS, timeout_s=60.0, progress=True,
                               submitted_at=time.monotonic() - 2.0))
            news = (await t.frontend.receive()).message
            assert isinstance(news, Progress) and news.elapsed_ms >= 2000


async def test_a_flood_of_step_reports_is_relayed_only_as_often_as_a_client_can_use_it() -> None:
    """A worker sends a Step at most every progress_interval_s; one that sends thousands at once
    (or repeats one, or goes back) must not make the daemon send each to the client. Before,
    every report became a Progress: 256,000 Steps from one denoiser held up every other
    request on the daemon for 11 s and overflowed the client's replies."""
    with anyio.fail_after(5):
        async with running_tracker() as t:
            t.inbox.post(Admit(request_id="r1", params=PARAMS, timeout_s=60.0, progress=True,
                               submitted_at=time.monotonic()))
            await t.admission.receive()
            await t.frontend.receive()  # encoding
            t.inbox.post(handed_off("r1", "encoder"))
            await t.frontend.receive()  # denoising
            for step in range(1, 1001):
                t.inbox.post(Stepped(request_id="r1", step=step, steps=20))
            assert (await t.frontend.receive()).message.step == 1
            await t.stats()
            t.assert_silent()
            await anyio.sleep(2 * MIN_STEP_GAP_S)
            t.inbox.post(Stepped(request_id="r1", step=1, steps=20))  # a repeat, or out of order
            await t.stats()
            t.assert_silent()
            t.inbox.post(Stepped(request_id="r1", step=7, steps=20))
            assert (await t.frontend.receive()).message.step == 7


async def test_a_short_deadline_still_expires_first_after_the_deadline_heap_is_rebuilt() -> None:
    """Ended requests leave their heap entries behind until the heap is rebuilt from the
    table: rebuilt in the table's order and not made a heap, a short deadline behind an older
    long one would never expire at its time."""
    with anyio.fail_after(30):
        async with running_tracker() as t:
            now = time.monotonic()
            t.inbox.post(Admit(request_id="long", params=PARAMS, timeout_s=600, submitted_at=now))
            t.inbox.post(Admit(request_id="short", params=PARAMS, timeout_s=1.0, submitted_at=now))
            for i in range(1100):  # past 2 x live + 1024 stale entries: rebuilt once
                t.inbox.post(Admit(request_id=f"f{i}", params=PARAMS, timeout_s=600, submitted_at=now))
                t.inbox.post(CancelRequest(request_id=f"f{i}"))
                if i % 5 == 0:  # the mailbox holds 32
                    await t.stats()
                    queued(t.admission)
                    queued(t.frontend)
            await t.stats()
            queued(t.admission)
            queued(t.frontend)
            await anyio.sleep(max(0.0, now + 1.1 - time.monotonic()))
            t.inbox.post(Tick())
            await t.stats()
            ended = [m.message for m in queued(t.frontend) if isinstance(m, Deliver)]
            assert [(e.request_id, e.reason) for e in ended if isinstance(e, Rejected)] == [("short", Reason.TIMED_OUT)]
