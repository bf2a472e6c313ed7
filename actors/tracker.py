"""TrackerActor: the table of live requests, their deadlines, and how each one ends.

Every request ends here exactly once: with a ``Result``, or with a ``Rejected`` followed by
a ``Forget`` that travels admission -> pools -> negotiator, which frees what the request
holds. Deadlines sit in a heap checked on each ``Tick``: expiry costs
O(log n) per request, never a scan of the table.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import assert_never

import anyio
import msgspec
import structlog

from actors.base import reply_once, serve_mailbox
from actors.latency import LatencyBook
from actors.mail import (
    RETRIED,
    AdmissionMail,
    Admit,
    CancelRequest,
    Deliver,
    EndAll,
    Enqueue,
    Failed,
    Finished,
    Forget,
    HandedOff,
    Job,
    QueryStats,
    Queued,
    StartDrain,
    Stepped,
    Tick,
    TrackerMail,
)
from actors.mailbox import Mailbox, MailboxCounts
from actors.pace import Pace
from actors.recent import RecentIds
from actors.states import ACTIVE_BY_ROLE, WHERE, RequestState, check_move
from transfer.protocol import Latency, Progress, Reason, Rejected, Result, StageTiming, next_role

log = structlog.get_logger()

# The least time between two Steps relayed to a client. A worker reports one at most every
# progress_interval_s (0.5 s by default), far apart from this: only a broken worker sends
# them faster, and relaying each would spend the daemon on one client's progress.
MIN_STEP_GAP_S = 0.01

# How long, and for how many requests at once, a retriable failure is remembered for a
# cancel that crossed it: the two cross only while in the mailboxes between frontend and
# tracker, a loop turn or two; the bound keeps a storm of failures from holding memory.
CROSSING_S = 10.0
CROSSING_MOST = 4096


@dataclass(slots=True)
class Entry:
    state: RequestState
    deadline: float
    submitted_at: float  # when the frontend took its Submit: its total_ms counts from here
    stage_started: float
    progress: bool  # its client wants Progress messages
    px: int  # pixels it makes, for its estimate (actors/pace.py)
    steps: int  # denoising steps, as asked, then as its denoiser reports them
    stages: list[StageTiming] = field(default_factory=list)
    first_step: tuple[float, int] | None = None  # (when, steps done) at its first step report
    last_step: tuple[float, int] | None = None  # (when, steps done) at the latest step report relayed
    own_step_ms: float | None = None  # its denoiser's pace since then
    # How long the stage before waited for this one's slot (HandedOff.waited_ms): queueing
    # for this stage, though spent before its window opened.
    carried_ms: float = 0.0


class TrackerStats(msgspec.Struct, frozen=True):
    by_state: dict[str, int]
    completed: int
    failed_by_reason: dict[str, int]
    latency: dict[str, Latency]
    handoff_bytes: dict[str, int]
    mailbox: MailboxCounts


class TrackerActor:
    """Owns the request table and the deadline heap."""

    def __init__(
        self,
        inbox: Mailbox[TrackerMail],
        *,
        frontend: Mailbox,
        admission: Mailbox[AdmissionMail],
    ) -> None:
        self._inbox = inbox
        self._frontend = frontend
        self._admission = admission
        self._table: dict[str, Entry] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._completed = 0
        self._failed: dict[str, int] = {}
        # Requests just failed for a reason the frontend retries, by (key, reason): a cancel
        # that crossed such a failure on its way here makes the frontend answer the client
        # `cancelled` instead, and the count follows what the client was told.
        self._crossable = RecentIds(window_s=CROSSING_S, most=CROSSING_MOST)
        self._drained: anyio.Event | None = None
        self._pace = Pace()
        self._latency = LatencyBook()
        self._log = log.bind(actor="tracker")

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await serve_mailbox(self._inbox, self._handle, task_status=task_status)

    def _handle(self, mail: TrackerMail) -> None:
        match mail:
            case Admit(request_id=rid, params=params, timeout_s=timeout_s, priority=priority, progress=progress,
                       submitted_at=submitted_at, avoid=avoid, again=again):
                now = time.monotonic()
                deadline = now + timeout_s
                entry = self._table[rid] = Entry(RequestState.ENCODING, deadline, submitted_at, now, progress,
                                                 params.pixels, params.steps)
                heapq.heappush(self._deadlines, (deadline, rid))
                self._compact_deadlines()
                self._admission.post(Enqueue(job=Job(request_id=rid, role="encoder", params=params, deadline=deadline,
                                                     priority=priority, progress=progress, avoid=avoid, again=again)))
                self._tell_progress(rid, entry, now)
            case HandedOff():
                self._handed_off(mail)
            case Finished():
                self._finished(mail)
            case Failed(request_id=rid, reason=reason, message=message, avoid=avoid):
                self._fail(rid, reason, message, avoid)
            case CancelRequest(request_id=rid, why=why):
                self._cancel(rid, why)
            case Stepped(request_id=rid, step=step, steps=steps):
                entry = self._table.get(rid)
                now = time.monotonic()
                if entry is not None and self._news(entry, now, step):
                    self._stepped(entry, now, step, steps)
                    self._tell_progress(rid, entry, now, step=step, steps=steps)
            case Queued(request_id=rid, role=role, position=position):
                entry = self._table.get(rid)
                if entry is not None:
                    # Waiting for the next stage's slot while this one's output is staged.
                    self._tell_progress(rid, entry, time.monotonic(), state=ACTIVE_BY_ROLE[role], position=position)
            case Tick():
                self._expire(time.monotonic())
            case StartDrain(drained=drained):
                self._drained = drained
                self._check_drained()
            case EndAll(message=message):
                for rid in list(self._table):
                    self._fail(rid, Reason.DRAINING, message)
            case QueryStats(reply=reply):
                by_state: dict[str, int] = {}
                for entry in self._table.values():
                    by_state[entry.state] = by_state.get(entry.state, 0) + 1
                reply_once(reply, TrackerStats(by_state, self._completed, dict(self._failed), self._latency.latency(),
                                               self._latency.handoff_bytes(), self._inbox.counts()))
            case _:
                assert_never(mail)

    def _handed_off(self, mail: HandedOff) -> None:
        entry = self._table.get(mail.request_id)
        if entry is None or entry.state != ACTIVE_BY_ROLE[mail.role]:
            return  # late news about a request that already ended
        now = time.monotonic()
        self._record_stage(entry, StageTiming(
            role=mail.role, instance=mail.instance,
            queued_ms=self._queued_ms(entry, now, mail.compute_ms + mail.transfer_ms + mail.waited_ms),
            compute_ms=mail.compute_ms, transfer_ms=mail.transfer_ms, transfer_bytes=mail.nbytes,
            fast_path=mail.fast_path, via=mail.via))
        if mail.role == "encoder":
            self._pace.encoded(mail.compute_ms, mail.transfer_ms)
        else:
            self._pace.denoised(mail.compute_ms, mail.transfer_ms, steps=entry.steps, px=entry.px)
        following = next_role(mail.role)
        assert following is not None, "the decoder hands nothing off"
        self._move(entry, ACTIVE_BY_ROLE[following])
        entry.stage_started, entry.carried_ms = now, mail.waited_ms
        self._tell_progress(mail.request_id, entry, now)

    @staticmethod
    def _queued_ms(entry: Entry, now: float, busy_ms: float) -> float:
        """What of the stage's wall time was not ``busy_ms`` (its compute, transfer and wait
        for room), plus the wait for room carried over from the stage before."""
        return max(0.0, (now - entry.stage_started) * 1000 - busy_ms) + entry.carried_ms

    def _record_stage(self, entry: Entry, timing: StageTiming) -> None:
        entry.stages.append(timing)
        self._latency.stage(timing)

    @staticmethod
    def _news(entry: Entry, now: float, done: int) -> bool:
        """Whether a step report of ``done`` steps is worth relaying: it moves on from the last
        one relayed, and not within MIN_STEP_GAP_S of it (a repeated, reordered or flooding
        report is dropped)."""
        if entry.last_step is not None and (done <= entry.last_step[1] or now - entry.last_step[0] < MIN_STEP_GAP_S):
            return False
        entry.last_step = (now, done)
        return True

    @staticmethod
    def _stepped(entry: Entry, now: float, done: int, steps: int) -> None:
        """Its denoiser reported ``done`` of ``steps``: its own pace, from its second report on."""
        entry.steps = steps or entry.steps
        if entry.first_step is None:
            entry.first_step = (now, done)
        elif done > entry.first_step[1]:
            entry.own_step_ms = (now - entry.first_step[0]) * 1000 / (done - entry.first_step[1])

    def _tell_progress(self, rid: str, entry: Entry, now: float, *, state: RequestState | None = None,
                       step: int = 0, steps: int = 0, position: int = 0) -> None:
        """A ``Progress`` to the client, if it asked for them."""
        if entry.progress:
            state = state or entry.state
            eta_ms = self._pace.remaining_ms(state, px=entry.px, steps=entry.steps, done=step,
                                             own_step_ms=entry.own_step_ms)
            self._frontend.post(Deliver(request_id=rid, message=Progress(
                request_id=rid, state=state, elapsed_ms=(now - entry.submitted_at) * 1000, step=step,
                steps=steps, position=position, eta_ms=eta_ms)))

    def _finished(self, mail: Finished) -> None:
        rid = mail.request_id
        entry = self._table.get(rid)
        if entry is None or entry.state != RequestState.DECODING:
            return
        now = time.monotonic()
        self._record_stage(entry, StageTiming(role="decoder", instance=mail.instance,
                                              queued_ms=self._queued_ms(entry, now, mail.compute_ms),
                                              compute_ms=mail.compute_ms))
        self._pace.decoded(mail.compute_ms, px=entry.px)
        self._move(entry, RequestState.DONE)
        del self._table[rid]
        self._completed += 1
        total_ms = (now - entry.submitted_at) * 1000
        self._latency.observe("request", total_ms)
        result = Result(request_id=rid, outputs=mail.outputs, stages=entry.stages, total_ms=total_ms)
        self._frontend.post(Deliver(request_id=rid, message=result, frames=mail.frames))
        self._log.info("request.done", request_id=rid, total_ms=round(total_ms, 3), stages=entry.stages)
        self._check_drained()

    def _cancel(self, rid: str, why: str) -> None:
        if rid in self._table:
            self._fail(rid, Reason.CANCELLED, why)
            return
        now = time.monotonic()
        crossed = next((reason for reason in RETRIED if self._crossable.take((rid, reason), now)), None)
        if crossed is not None:  # the frontend asked first: its client hears `cancelled`, nothing is retried
            self._failed[crossed] -= 1
            if not self._failed[crossed]:
                del self._failed[crossed]
            self._failed[Reason.CANCELLED] = self._failed.get(Reason.CANCELLED, 0) + 1

    def _fail(self, rid: str, reason: Reason, message: str, avoid: frozenset[str] = frozenset()) -> None:
        entry = self._table.pop(rid, None)
        if entry is None:
            return  # already ended: a second failure report changes nothing
        check_move(entry.state, RequestState.FAILED)
        self._failed[reason] = self._failed.get(reason, 0) + 1
        if reason in RETRIED:
            self._crossable.add((rid, reason), time.monotonic())
        self._frontend.post(Deliver(request_id=rid, message=Rejected(request_id=rid, reason=reason, message=message),
                                    avoid=avoid))
        # Every owner frees its own part. The Forget travels admission -> pools ->
        # negotiator, so at each hop it arrives after anything the previous owner said
        # about the request (a dispatch, a reservation): nothing can restart it.
        self._admission.post(Forget(request_id=rid))
        self._log.warning("request.failed", request_id=rid, reason=str(reason), message=message, state=str(entry.state))
        self._check_drained()

    def _expire(self, now: float) -> None:
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, rid = heapq.heappop(heap)
            entry = self._table.get(rid)
            if entry is not None:  # else it ended before its deadline
                self._fail(rid, Reason.TIMED_OUT, f"deadline passed while {WHERE[entry.state]}")

    def _compact_deadlines(self) -> None:
        # Finished requests leave their heap entries behind (deleting from a heap's middle
        # is O(n)); rebuilding once the stale ones outnumber the live keeps memory bounded
        # by the table at amortised O(1) per request.
        if len(self._deadlines) > 2 * len(self._table) + 1024:
            self._deadlines = [(entry.deadline, rid) for rid, entry in self._table.items()]
            heapq.heapify(self._deadlines)

    def _move(self, entry: Entry, new: RequestState) -> None:
        check_move(entry.state, new)
        entry.state = new

    def _check_drained(self) -> None:
        if self._drained is not None and not self._table:
            self._drained.set()
