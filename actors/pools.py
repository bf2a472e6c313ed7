"""PoolActor: one per role. Membership, free slots, the dispatch policy, work sockets.

A slot is the unit of a worker's capacity: taken when a job is dispatched to (or a hand-off
reserved at) an instance, given back when that instance no longer holds the request, or,
for a request that ended while its stage ran there, when that run is over. The
pool is the only sender on each instance's PUSH socket; every order is prefixed with the
key the worker was given at registration, so nobody else can drive a worker. An instance
the negotiator suspects (silent, a push into it failed, stopping, or a push of its overdue)
keeps its slots but is offered none, and so does a new instance until its first order, a
``Probe``, is known to have reached it.

A receiver is offered only jobs whose input its memory can ever hold (``Join.fits``), so
workers of one role may have pools of different sizes, and an instance only jobs its
limits admit (``Join.limits``): the door admits what every registered worker takes, but a
worker with tighter ``[model.limits]`` may join after a request was let in. A job that only
busy workers can take waits here, its slot of admission's count handed back for other
jobs, and takes the next slot that frees at one that can: the highest priority first, then
the oldest. Finding it scans those waiting, which only a pool of unequal workers ever has.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import assert_never

import anyio
import msgspec
import structlog
import zmq

from actors.base import reply_once, serve_mailbox
from actors.dispatch import make_policy
from actors.mail import (
    AdmissionMail,
    Credit,
    Dispatch,
    Enqueue,
    Failed,
    Forget,
    Job,
    Join,
    Leave,
    NegotiatorMail,
    Placed,
    PoolMail,
    QueryStats,
    Queued,
    Release,
    RunEnded,
    Send,
    Stuck,
    Suspect,
    TrackerMail,
)
from actors.mailbox import Mailbox, MailboxCounts
from orchestrator.limits import limits_violation
from transfer.protocol import ORDERS_PER_MESSAGE, Abort, Probe, Reason, Role, StageLimits, WorkOrder, encode
from transfer.sockets import NOBLOCK, send_frames

log = structlog.get_logger()


@dataclass(slots=True)
class Instance:
    instance: str
    name: str
    address: str
    session: str
    key: bytes
    capacity: int
    socket: zmq.Socket
    fits: int  # Join.fits: the largest input it can ever take
    limits: StageLimits  # Join.limits: what requests it takes
    free: int = 0
    finishing: int = 0  # slots held by runs of requests that ended, until those runs end
    served: int = 0
    failed: int = 0
    # Its free slots are withheld from admission and dispatch: from its join until its
    # Probe is known to have arrived, and while the negotiator suspects it.
    suspect: bool = True
    holding: set[str] = field(default_factory=set)
    unsent: list[WorkOrder] = field(default_factory=list)  # leaving together at the next flush


class InstanceSlots(msgspec.Struct, frozen=True):
    instance: str
    name: str
    address: str
    session: str
    slots_free: int
    slots_total: int
    slots_finishing: int
    served: int
    failed: int
    suspect: bool


class PoolStats(msgspec.Struct, frozen=True):
    role: str
    instances: list[InstanceSlots]
    waiting: int  # jobs waiting for a worker that can take them (its memory, its limits)
    mailbox: MailboxCounts


class PoolActor:
    """Owns one role's instances, their free slots and their work sockets."""

    def __init__(
        self,
        role: Role,
        inbox: Mailbox[PoolMail],
        *,
        ctx: zmq.Context,
        policy: str,
        send_hwm: int,
        admission: Mailbox[AdmissionMail],
        tracker: Mailbox[TrackerMail],
        negotiator: Mailbox[NegotiatorMail],
    ) -> None:
        self.role = role
        self._inbox = inbox
        self._ctx = ctx
        self._policy = make_policy(policy)
        self._send_hwm = send_hwm
        self._admission = admission
        self._tracker = tracker
        self._negotiator = negotiator
        self._instances: dict[str, Instance] = {}
        self._holds: dict[str, str] = {}  # request -> the instance holding a slot for it
        self._bounced: set[str] = set()  # jobs handed back to admission for lack of an instance
        self._unsent: dict[str, Instance] = {}  # instances with orders waiting for the flush
        self._by_fits: list[tuple[int, str]] = []  # (fits, instance), ascending
        # The instances by their limits: one entry in all but a pool of unequal workers, so
        # a job's check against them costs one limits check a dispatch.
        self._by_limits: dict[StageLimits, set[str]] = {}
        self._waiting: dict[str, Job] = {}  # jobs only a busy instance can hold, oldest first
        self._log = log.bind(actor="pool", role=role)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            await serve_mailbox(self._inbox, self._handle, task_status=task_status)
        finally:
            for inst in self._instances.values():
                inst.socket.close(linger=0)

    def _handle(self, mail: PoolMail) -> None:
        match mail:
            case Dispatch(job=job):
                self._dispatch(job)
            case Send(instance=instance, order=order):
                inst = self._instances.get(instance)
                if inst is None:
                    if not isinstance(order, Abort):
                        self._tracker.post(Failed(request_id=order.request_id, reason=Reason.WORKER_LOST,
                                                   message=f"{self.role} {instance} left before {type(order).__name__}",
                                                   avoid=frozenset({instance})))
                    return
                self._send(inst, order)
            case Release():
                self._release(mail)
            case RunEnded(instance=instance):
                inst = self._instances.get(instance)
                if inst is not None and inst.finishing > 0:
                    inst.finishing -= 1
                    self._give_slot(inst)
            case Forget(request_id=rid):
                # Slots stay held: the negotiator frees them once the request's transfers
                # are safely over. Passing the Forget on after any Placed this pool posted
                # keeps the negotiator from ever restarting a request that ended.
                self._negotiator.post(mail)
                self._waiting.pop(rid, None)
                if rid in self._bounced:
                    # Admission may have handled this Forget before the job came back to
                    # it; this copy arrives behind the requeue and removes it.
                    self._bounced.discard(rid)
                    self._admission.post(mail)
            case Suspect(instance=instance, suspect=suspect):
                inst = self._instances.get(instance)
                if inst is not None and inst.suspect != suspect:
                    self._suspect(inst, suspect)
            case Join():
                self._join(mail)
            case Leave(instance=instance, message=message):
                self._leave(instance, message)
            case QueryStats(reply=reply):
                reply_once(reply, PoolStats(self.role, [
                    InstanceSlots(i.instance, i.name, i.address, i.session, i.free, i.capacity, i.finishing,
                                  i.served, i.failed, i.suspect)
                    for i in self._instances.values()
                ], len(self._waiting), self._inbox.counts()))
            case _:
                assert_never(mail)

    def _dispatch(self, job: Job) -> None:
        self._bounced.discard(job.request_id)
        picked = self._pick(job)
        if picked is not None:
            self._place(self._instances[picked], job)
        elif self._policy.has_room():
            # Free slots, but none at a worker that can take it (its input, its limits): it
            # waits for one here, and the slot goes back to admission for a job that fits it.
            self._waiting[job.request_id] = job
            self._admission.post(Credit(role=self.role, delta=1))
            if job.progress:
                self._tracker.post(Queued(request_id=job.request_id, role=self.role,
                                          position=self._waiting_before(job) + 1))
        else:
            # The slot admission counted on left with its worker: requeue the job first in
            # line and give back the credit spent on it.
            self._bounced.add(job.request_id)
            self._admission.post(Enqueue(job=job, front=True))
            self._admission.post(Credit(role=self.role, delta=1))

    def _release(self, mail: Release) -> None:
        rid = mail.request_id
        if self._holds.get(rid) != mail.instance:
            return
        inst = self._instances[mail.instance]
        if mail.ok is True:
            inst.served += 1
        elif mail.ok is False:
            inst.failed += 1
        self._let_go(inst, rid)
        if mail.finishing:
            # Not the request's any more (its id may come back in a new request), but busy:
            # given work now, the worker would hold it behind that run.
            inst.finishing += 1
        else:
            self._give_slot(inst)

    def _pick(self, job: Job) -> str | None:
        """An instance with a free slot that can take ``job`` (its memory, its limits),
        preferring one its failed attempts did not involve; None if none has both."""
        unfit = self._unfit(job)
        if not unfit:
            return self._policy.pick(job.avoid)
        picked = self._policy.pick(job.avoid | unfit)
        if picked in unfit:  # every one that fits with room is avoided: take one of those
            picked = self._policy.pick(unfit)
        return None if picked in unfit else picked

    def _unfit(self, job: Job) -> frozenset[str]:
        """Instances that can never take ``job``: their memory cannot hold its input, or their
        limits refuse it (one that joined after the door let it in). Usually none."""
        nbytes = job.nbytes
        small = () if not self._by_fits or nbytes <= self._by_fits[0][0] else (
            instance for _, instance in self._by_fits[:bisect.bisect_left(self._by_fits, (nbytes, ""))])
        refused = [names for limits, names in self._by_limits.items() if limits_violation(limits, job.params)]
        if not refused:
            return frozenset(small)
        return frozenset(small).union(*refused)

    def _can_take(self, inst: Instance, job: Job) -> bool:
        return job.nbytes <= inst.fits and limits_violation(inst.limits, job.params) is None

    def _place(self, inst: Instance, job: Job) -> None:
        self._take(inst, job.request_id)
        # The negotiator records the request's flight before any order goes out, so even
        # an instant worker's first report finds it.
        self._negotiator.post(Placed(job=job, instance=inst.instance))

    def _waiting_for(self, inst: Instance) -> Job | None:
        """The waiting job ``inst`` should take next: the highest priority, then the oldest,
        among those it can hold whose deadline has not passed (the tracker ends those)."""
        now = time.monotonic()
        chosen: Job | None = None
        for job in self._waiting.values():
            if job.deadline > now and (chosen is None or job.priority > chosen.priority) and self._can_take(inst, job):
                chosen = job
        return chosen

    def _waiting_before(self, job: Job) -> int:
        """How many waiting jobs go before ``job`` (the same order as ``_waiting_for``;
        those that fit another worker than ``job``'s may go to that one instead)."""
        return sum(1 for other in self._waiting.values() if other.priority >= job.priority) - 1

    def _serve_waiting(self, inst: Instance) -> None:
        """Give ``inst``'s free slots to the jobs waiting for a worker like it."""
        while self._waiting and inst.free > 0:
            job = self._waiting_for(inst)
            if job is None:
                return
            del self._waiting[job.request_id]
            self._place(inst, job)

    def _take(self, inst: Instance, rid: str) -> None:
        inst.free -= 1
        inst.holding.add(rid)
        self._holds[rid] = inst.instance
        self._policy.update(inst.instance, inst.free)

    def _let_go(self, inst: Instance, rid: str) -> None:
        del self._holds[rid]
        inst.holding.discard(rid)

    def _give_slot(self, inst: Instance) -> None:
        inst.free += 1
        if inst.suspect:
            return
        self._serve_waiting(inst)
        if inst.free > 0:  # not taken by a waiting job: admission's to hand out
            self._policy.update(inst.instance, inst.free)
            self._admission.post(Credit(role=self.role, delta=1))

    def _suspect(self, inst: Instance, suspect: bool) -> None:
        """Withhold ``inst``'s free slots from dispatch and admission, or give them back.

        Admission must stop counting them too: a job it dispatched on their credit would
        find no instance to take it and come straight back, again and again.
        """
        inst.suspect = suspect
        if not suspect:
            self._serve_waiting(inst)
        self._policy.update(inst.instance, 0 if suspect else inst.free)
        self._admission.post(Credit(role=self.role, delta=-inst.free if suspect else inst.free))
        if suspect:
            self._log.warning("pool.suspect", instance=inst.instance, free=inst.free)
        else:
            self._log.info("pool.trusted", instance=inst.instance, free=inst.free)

    def _send(self, inst: Instance, order: WorkOrder) -> None:
        """Queue ``order``: an instance's orders leave as one message once the daemon is quiet."""
        if not self._unsent:
            self._inbox.board.when_quiet(self._flush)
        inst.unsent.append(order)
        self._unsent[inst.instance] = inst

    def _flush(self) -> None:
        unsent, self._unsent = self._unsent, {}
        for inst in unsent.values():
            orders, inst.unsent = inst.unsent, []
            for start in range(0, len(orders), ORDERS_PER_MESSAGE):
                try:
                    # Never block the loop on one worker: a full queue (SNDHWM) means it is stuck.
                    send_frames(inst.socket, [inst.key, *map(encode, orders[start : start + ORDERS_PER_MESSAGE])],
                                NOBLOCK)
                except zmq.Again:
                    # Its requests fail when it is evicted; an Abort lost here would leave memory
                    # held at the worker, which its rejoin frees.
                    lost = orders[start:]
                    self._log.error("pool.worker_stuck", instance=inst.instance, orders=len(lost),
                                    requests=[order.request_id for order in lost])
                    self._negotiator.post(Stuck(instance=inst.instance,
                                                message=f"{self.role} {inst.instance} is not taking work"))
                    break

    def _join(self, mail: Join) -> None:
        # A plain socket even under an asyncio context: sends are NOBLOCK and never
        # awaited, and only a plain socket raises zmq.Again instead of hiding it in a Future.
        sock = zmq.Socket(self._ctx, zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self._send_hwm)
        sock.connect(mail.work_address)
        inst = Instance(mail.instance, mail.name, mail.work_address, mail.session, mail.key, mail.capacity, sock,
                        mail.fits, mail.limits, free=mail.capacity)
        self._instances[mail.instance] = inst
        bisect.insort(self._by_fits, (mail.fits, mail.instance))
        self._by_limits.setdefault(mail.limits, set()).add(mail.instance)
        # Offered no work until the negotiator hears the Probe arrived (a Suspect(False)).
        self._policy.update(mail.instance, 0)
        send_frames(sock, [mail.key, encode(Probe(instance=mail.instance))], NOBLOCK)
        self._log.info("pool.joined", instance=mail.instance, name=mail.name, address=mail.work_address,
                       capacity=mail.capacity)

    def _leave(self, instance: str, message: str) -> None:
        inst = self._instances.pop(instance, None)
        if inst is None:
            return
        self._policy.remove(instance)
        self._by_fits.remove((inst.fits, instance))
        alike = self._by_limits[inst.limits]
        alike.discard(instance)
        if not alike:
            del self._by_limits[inst.limits]
        self._unsent.pop(instance, None)  # its requests fail below; its socket closes
        if not inst.suspect:  # a suspect's free slots were withdrawn already
            self._admission.post(Credit(role=self.role, delta=-inst.free))
        for rid in inst.holding:
            del self._holds[rid]
            self._tracker.post(Failed(request_id=rid, reason=Reason.WORKER_LOST, message=message,
                                       avoid=frozenset({instance})))
        inst.socket.close(linger=0)
        self._log.warning("pool.left", instance=instance, message=message,
                          lost=len(inst.holding))
