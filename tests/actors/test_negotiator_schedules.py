"""TransferNegotiator under random schedules: however its hand-offs go, everything comes back.

The other negotiator tests replay chosen races mail by mail. Here hypothesis picks the
schedule: one to four requests, each walking encoder -> denoiser -> decoder along the
happy path (cut short anywhere) with disruptions spliced in, the requests interleaved.
The disruptions: a Staged too big for any preallocated slot (slow path), with a bad
manifest, or from a worker not running the request; an ``AllocRejected`` or an
allocation outside the pool; a failed push, or one in doubt (timed out); a failed or misplaced ``Done``; a ``Forget``
at any point; duplicate, forged and late reports, also after the request ended; Ticks,
before and after a (short) push quarantine. The fake workers behave like real ones: each
answers only what it was ordered (a ``Pushed`` after a ``Push``, an answer after an
``Alloc``), but an answer may cross the request's end and arrive late. No worker is
evicted here (test_negotiator_end.py covers evictions): there is one of each role.

After the schedule, whatever is left is forgotten and the quarantine runs out. Since the
negotiator alone frees what a placed request holds (protocol.md §4.4), everything it
handed out must then be back, exactly once:

- every receiver's preallocated slots are free, and no flight is left in a hand-off;
- every pool slot reserved for the request (each ``Placed`` the test posted) was given
  back by exactly one ``Release`` for that request and instance, and nothing else was;
- every ``Alloc`` ordered into a receiver, and every allocation a receiver reported, was
  followed there by a ``Ready`` (the request runs in that memory) or an ``Abort`` (the
  receiver frees it);
- every block a worker reported staged was freed: by an ``Abort`` to it, or by its own
  ``Pushed`` after a ``Push`` order;
- a request gets at most one terminal mail (``Failed`` or ``Finished``), none after its
  ``Forget``, and once it ended nothing starts work for it again (no ``Work``, ``Alloc``,
  ``Push``, ``Ready``, ``Enqueue`` or ``HandedOff``).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import mkdtemp
from typing import Any, NamedTuple

import anyio
import zmq.asyncio
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from actors.mail import Enqueue, Failed, Finished, Forget, HandedOff, Placed, Release, Send, Tick
from actors.negotiator import NegotiatorStats
from tests.actors.negotiator_harness import (
    MANIFEST,
    NBYTES,
    POOL_BASE,
    SLOT_SIZE,
    FakeWorker,
    Negotiator,
    fake_worker,
    job,
    running_negotiator,
    wait_late,
)
from transfer.protocol import (
    ROLES,
    Abort,
    Alloc,
    Allocated,
    AllocRejected,
    Done,
    Push,
    Pushed,
    Ready,
    Role,
    Staged,
    TensorSpec,
    Work,
    WorkerMessage,
    encode,
)
from transfer.protocol import Step as StepReport

QUARANTINE_S = 0.05  # push_quarantine_s: short, so a doomed flight's memory comes back within the example
BIG = 4 * SLOT_SIZE  # a staged output no preallocated slot holds: the slow path
ALLOCATION = POOL_BASE + 8 * SLOT_SIZE  # where receivers allocate: inside their pool
BAD_MANIFEST = [TensorSpec(name="embeds", dtype="float32", shape=(128,), offset=NBYTES, nbytes=NBYTES, xxh3=1)]
# Sent behind every report in the same message: a report about no request, so it counts as
# late. A message is handled whole and in order, so once the count moves the report before
# it has been handled, and all the mail it caused has been posted.
SYNC = encode(StepReport(request_id="sync", step=0, steps=1))

# What a worker can report about a request: which order it answers (a View field naming
# the worker's role) and the report.
REPORTS: dict[str, tuple[str, Callable[[str], WorkerMessage]]] = {
    "stage": ("running", lambda rid: Staged(request_id=rid, nbytes=NBYTES, manifest=MANIFEST, compute_ms=1.0)),
    "stage_big": ("running", lambda rid: Staged(request_id=rid, nbytes=BIG, manifest=MANIFEST, compute_ms=1.0)),
    "stage_bad": ("running", lambda rid: Staged(request_id=rid, nbytes=NBYTES, manifest=BAD_MANIFEST,
                                                compute_ms=1.0)),
    "done": ("running", lambda rid: Done(request_id=rid, ok=True, compute_ms=1.0)),
    "done_failed": ("running", lambda rid: Done(request_id=rid, ok=False, compute_ms=1.0, error="oom")),
    "allocated": ("allocating", lambda rid: Allocated(request_id=rid, address=ALLOCATION)),
    "alloc_outside": ("allocating", lambda rid: Allocated(request_id=rid, address=0)),
    "alloc_rejected": ("allocating", lambda rid: AllocRejected(request_id=rid, message="pool full")),
    "pushed": ("pushing", lambda rid: Pushed(request_id=rid, ok=True, transfer_ms=1.0)),
    "push_failed": ("pushing", lambda rid: Pushed(request_id=rid, ok=False, transfer_ms=0.0, error="link down")),
    "push_in_doubt": ("pushing", lambda rid: Pushed(request_id=rid, ok=False, transfer_ms=0.0, error="timed out",
                                                    in_doubt=True)),
}
KINDS = ("place", *REPORTS, "duplicate", "forged", "forget", "tick", "expire")


class Action(NamedTuple):
    request: int  # which request ("r0", "r1", ...); "tick" and "expire" ignore it
    kind: str  # one of KINDS


# --------------------------------------------------------------------------- schedules


@st.composite
def request_script(draw: st.DrawFn, request: int) -> list[Action]:
    """One request's path through the stages, cut short anywhere, maybe forgotten before any
    of its steps, some steps replaced or preceded by any action, and a few more actions
    after it (late reports, mostly)."""

    def hop() -> list[str]:
        # The receiver's answer does nothing on the fast path: nobody asked it to allocate.
        # Mostly the answers that move the request on; the rest end it.
        return [draw(st.sampled_from(("stage", "stage_big"))), "place",
                draw(st.sampled_from(("allocated",) * 6 + ("alloc_rejected", "alloc_outside"))),
                draw(st.sampled_from(("pushed",) * 3 + ("push_failed", "push_in_doubt")))]

    path = ["place", *hop(), *hop(), draw(st.sampled_from(("done",) * 4 + ("done_failed",)))]
    # Cut past the end more often than not, so a fair share of requests get through to the decoder.
    path = path[: draw(st.integers(1, 3 * len(path)))]
    # Ended elsewhere (cancelled, timed out) before its k-th step: in the middle of a
    # hand-off as likely as not, since every other step of a hop is its answer.
    forget_at = draw(st.none() | st.integers(0, len(path)))
    script = []
    for k, kind in enumerate(path):
        if k == forget_at:
            script.append("forget")
        edit = draw(st.sampled_from(("keep",) * 12 + ("replace", "insert")))
        if edit != "keep":
            script.append(draw(st.sampled_from(KINDS)))
        if edit != "replace":
            script.append(kind)
    if forget_at == len(path):
        script.append("forget")
    script += draw(st.lists(st.sampled_from(KINDS), max_size=3))
    return [Action(request, kind) for kind in script]


@st.composite
def schedules(draw: st.DrawFn) -> list[Action]:
    # Sampled, not integers: those would favour a single request, which races with nobody.
    scripts = [draw(request_script(r)) for r in range(draw(st.sampled_from((1, 2, 3, 4))))]
    # Which request acts next: the k-th time request r is picked, it takes its k-th action.
    turns = draw(st.permutations([r for r, script in enumerate(scripts) for _ in script]))
    actions = [iter(script) for script in scripts]
    return [next(actions[r]) for r in turns]


# --------------------------------------------------------------------------- the driver


@dataclass
class View:
    """What one request's fake workers were told, as real workers would know it."""

    started: bool = False  # its encoder job was placed
    unplaced: deque[Role] = field(default_factory=deque)  # next-stage jobs enqueued, not placed yet
    running: Role | None = None  # ordered Work or Ready, has not reported Staged or Done
    allocating: Role | None = None  # ordered Alloc, has not answered
    pushing: Role | None = None  # ordered Push, has not answered
    last: tuple[Role, WorkerMessage] | None = None  # the latest report, for a duplicate


class Reported(NamedTuple):
    step: int
    by: Role
    msg: WorkerMessage


class Posted(NamedTuple):
    step: int
    box: Role | str  # a pool (one worker per role, so the worker an order goes to), "admission" or "tracker"
    mail: Any


@dataclass
class Record:
    """What the test did and saw, each stamped with the schedule step it belongs to."""

    placed: list[tuple[Role, str, str]] = field(default_factory=list)  # (role, request, instance)
    # Reports and the mail they caused, in the order they happened: a report is handled
    # before the test takes the mail of its step.
    timeline: list[Reported | Posted] = field(default_factory=list)
    forgotten: dict[str, int] = field(default_factory=dict)  # request -> step of its first Forget
    ended: dict[str, int] = field(default_factory=dict)  # request -> step of its Forget or terminal mail


class Driver:
    def __init__(self, n: Negotiator, workers: dict[Role, FakeWorker], requests: int) -> None:
        self.n = n
        self.workers = workers
        self.views = {f"r{i}": View() for i in range(requests)}
        self.record = Record()

    async def act(self, step: int, action: Action) -> None:
        rid = f"r{action.request}"
        view = self.views[rid]
        match action.kind:
            case "place":
                self._place(rid, view)
            case "duplicate" if view.last is not None:
                await self._report(step, rid, *view.last)
            case "forged":
                await self._report(step, rid, *forged(rid, view))
            case "forget":
                self._forget(step, rid)
            case "tick":
                self.n.inbox.post(Tick())
            case "expire":
                await anyio.sleep(QUARANTINE_S * 1.2)
                self.n.inbox.post(Tick())
            case kind if kind in REPORTS:
                due, build = REPORTS[kind]
                by = getattr(view, due)
                if by is not None:
                    setattr(view, due, None)  # a worker answers an order once
                    view.last = (by, build(rid))
                    await self._report(step, rid, *view.last)
        await self._collect(step)

    async def finish(self, step: int) -> NegotiatorStats:
        """End every request that is left, and let the quarantine of any doomed push run out."""
        note("the schedule is over")
        for rid in self.views:
            self._forget(step, rid)
        await anyio.sleep(QUARANTINE_S * 1.2)
        self.n.inbox.post(Tick())
        await self._collect(step)
        return await self.n.stats()

    def _place(self, rid: str, view: View) -> None:
        if not view.started:
            if rid in self.record.forgotten:
                return  # admission dropped its queued encoder job
            view.started, role = True, "encoder"
        elif view.unplaced:
            role = view.unplaced.popleft()  # placed even after a Forget: the pool may have dispatched it first
        else:
            return
        instance = self.workers[role].instance
        note(f"Placed {rid} on {role}")
        self.record.placed.append((role, rid, instance))
        self.n.inbox.post(Placed(job=job(rid, role), instance=instance))

    def _forget(self, step: int, rid: str) -> None:
        note(f"Forget {rid}")
        self.record.forgotten.setdefault(rid, step)
        self.record.ended.setdefault(rid, step)
        for _ in ROLES:  # admission tells every pool, and each passes it on
            self.n.inbox.post(Forget(request_id=rid))

    async def _report(self, step: int, rid: str, by: Role, msg: WorkerMessage) -> None:
        note(f"{by} reports {msg!r}")
        self.record.timeline.append(Reported(step, by, msg))
        late = (await self.n.stats()).late_reports
        await self.workers[by].sock.send_multipart([encode(msg), SYNC])
        await wait_late(self.n, late + 1)

    async def _collect(self, step: int) -> None:
        """Take every mail the step caused, and learn from it what each worker was told."""
        await self.n.stats()
        for box in (*ROLES, "admission", "tracker"):
            for mail in self.n.take(box):
                self.record.timeline.append(Posted(step, box, mail))
                self._learn(step, box, mail)

    def _learn(self, step: int, box: str, mail: Any) -> None:
        match mail:
            case Send(order=Work(request_id=rid) | Ready(request_id=rid)):
                self.views[rid].running = box
            case Send(order=Alloc(request_id=rid)):
                self.views[rid].allocating = box
            case Send(order=Push(request_id=rid)):
                self.views[rid].pushing = box
            case Enqueue(job=queued):
                self.views[queued.request_id].unplaced.append(queued.role)
            case Failed(request_id=rid) | Finished(request_id=rid):
                self.record.ended.setdefault(rid, step)


def forged(rid: str, view: View) -> tuple[Role, WorkerMessage]:
    """The report ``rid`` waits for next, sent by a worker it is not due from (the next role's)."""
    if view.pushing is not None:
        due, kind = view.pushing, "pushed"
    elif view.allocating is not None:
        due, kind = view.allocating, "allocated"
    else:
        due, kind = view.running or "encoder", "stage"
    return ROLES[(ROLES.index(due) + 1) % len(ROLES)], REPORTS[kind][1](rid)


# --------------------------------------------------------------------------- the invariants


def request_of(mail: Any) -> str | None:
    match mail:
        case Send(order=order):
            return order.request_id
        case Enqueue(job=queued):
            return queued.request_id
        case HandedOff() | Failed() | Finished():
            return mail.request_id
    return None


def posted(record: Record) -> list[Posted]:
    return [entry for entry in record.timeline if isinstance(entry, Posted)]


def ordered(record: Record, since: int, role: Role, rid: str, *orders: type) -> list[int]:
    """Where in the timeline, after ``since``, ``role``'s worker was sent one of ``orders`` about ``rid``."""
    return [i for i, entry in enumerate(record.timeline) if i > since and isinstance(entry, Posted)
            and entry.box == role and isinstance(entry.mail, Send) and isinstance(entry.mail.order, orders)
            and entry.mail.order.request_id == rid]


def reported(record: Record, since: int, by: Role, rid: str, kind: type) -> bool:
    """Whether ``by``'s worker reported a ``kind`` about ``rid`` after ``since`` in the timeline."""
    return any(i > since and isinstance(entry, Reported) and entry.by == by and isinstance(entry.msg, kind)
               and entry.msg.request_id == rid for i, entry in enumerate(record.timeline))


def assert_receivers_are_free(stats: NegotiatorStats) -> None:
    assert stats.handoffs_in_flight == 0, stats
    for instance, counts in stats.prealloc.items():
        assert counts.free == counts.total, f"{instance} keeps {counts.total - counts.free} slots"


def assert_each_reservation_released_once(record: Record) -> None:
    releases = Counter((entry.box, entry.mail.request_id, entry.mail.instance) for entry in posted(record)
                       if isinstance(entry.mail, Release))
    assert releases == Counter(record.placed), f"released {dict(releases)}, reserved {record.placed}"


def assert_receiver_memory_is_used_or_freed(record: Record) -> None:
    """Each Alloc ordered, and each allocation reported, is followed by a Ready or an Abort there."""
    for i, entry in enumerate(record.timeline):
        match entry:
            case (Posted(box=role, mail=Send(order=Alloc(request_id=rid)))
                  | Reported(by=role, msg=Allocated(request_id=rid))):
                assert ordered(record, i, role, rid, Ready, Abort), f"{role}'s memory for {rid} kept: {entry}"


def assert_staged_blocks_are_freed(record: Record) -> None:
    """Each block reported staged is freed by an Abort, or by its worker's Pushed after a Push
    order. A report repeating one not yet followed by either is the same block, checked once."""
    for i, entry in enumerate(record.timeline):
        match entry:
            case Reported(by=by, msg=Staged(request_id=rid)) if not repeats_staged(record, i, by, rid):
                pushes = ordered(record, i, by, rid, Push)
                pushed = bool(pushes) and reported(record, pushes[0], by, rid, Pushed)
                assert ordered(record, i, by, rid, Abort) or pushed, f"{by}'s staged block kept: {entry}"


def repeats_staged(record: Record, at: int, by: Role, rid: str) -> bool:
    """Whether the Staged at ``at`` repeats an earlier one of ``by`` about ``rid`` whose block
    no Abort or Pushed has freed since."""
    earlier = [i for i, entry in enumerate(record.timeline[:at]) if isinstance(entry, Reported)
               and entry.by == by and isinstance(entry.msg, Staged) and entry.msg.request_id == rid]
    if not earlier:
        return False
    freed = [i for i in ordered(record, earlier[-1], by, rid, Abort) if i < at]
    return not freed and not any(
        earlier[-1] < i < at and isinstance(entry, Reported) and entry.by == by and isinstance(entry.msg, Pushed)
        and entry.msg.request_id == rid for i, entry in enumerate(record.timeline))


def assert_one_end_and_no_restart(record: Record) -> None:
    for rid, ended in record.ended.items():
        about = [entry for entry in posted(record) if request_of(entry.mail) == rid]
        terminal = [entry.step for entry in about if isinstance(entry.mail, Failed | Finished)]
        assert len(terminal) <= 1, f"{rid} ended {len(terminal)} times"
        forgotten = record.forgotten.get(rid)
        assert forgotten is None or all(step < forgotten for step in terminal), f"{rid}: terminal mail after Forget"
        restarted = [entry for entry in about if entry.step > ended and (
            isinstance(entry.mail, Enqueue | HandedOff)
            or isinstance(entry.mail, Send) and isinstance(entry.mail.order, Work | Alloc | Push | Ready))]
        assert not restarted, f"{rid} ended at step {ended}, then {restarted}"


# --------------------------------------------------------------------------- the test


# The fixtures are made once per test, not per example: fine, since every example starts its
# own negotiator in its own directory, and the zmq context only makes sockets.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Preallocated slots of the denoiser and the decoder (sampled, not integers: those would
# favour 0, and every hand-off would take the slow path).
@given(schedule=schedules(), slots=st.tuples(st.sampled_from((1, 2, 0)), st.sampled_from((1, 2, 0))))
async def test_every_schedule_gives_back_everything_the_hand_offs_held(
    ctx: zmq.asyncio.Context, tmp_path: Path, schedule: list[Action], slots: tuple[int, int]
) -> None:
    requests = 1 + max(action.request for action in schedule)
    with anyio.fail_after(10):
        async with AsyncExitStack() as stack:
            # heartbeat_s: the fake workers never beat; this keeps even a suspected one (a push
            # into it failed) from being evicted while the schedule runs.
            n = await stack.enter_async_context(running_negotiator(
                ctx, Path(mkdtemp(dir=tmp_path)), push_quarantine_s=QUARANTINE_S, heartbeat_s=3600.0))
            workers = {role: await stack.enter_async_context(fake_worker(ctx, n, role, slots=count))
                       for role, count in zip(ROLES, (0, *slots))}
            driver = Driver(n, workers, requests)
            for step, action in enumerate(schedule):
                await driver.act(step, action)
            stats = await driver.finish(len(schedule))
    # Checked outside the task group, so a failure reads as itself, not as an ExceptionGroup.
    assert_receivers_are_free(stats)
    assert_each_reservation_released_once(driver.record)
    assert_receiver_memory_is_used_or_freed(driver.record)
    assert_staged_blocks_are_freed(driver.record)
    assert_one_end_and_no_restart(driver.record)
