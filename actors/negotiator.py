"""TransferNegotiator: every hand-off between stages, and the link to every worker.

It owns the worker ROUTER (registration, heartbeats, everything workers report), the
preallocated receive slots of every receiver, and one ``Flight`` per request from the
moment a stage starts it until the decoder answers. Per hop it takes the fast path (a
free preallocated slot big enough: tell the sender to push at once) or the slow path
(ask the receiver to allocate, then push).

The tensors never come here: workers write into each other's memory with Mooncake and
only sizes, addresses and manifests cross this actor. The decoder's output frames pass
through untouched on their way to the frontend.

A worker whose ``Probe`` has not yet come back, one silent for two heartbeats, or a
receiver a push just failed to reach, is a suspect: it gets no new work until it is
reached or speaks again. A suspect whose push failed is evicted
if it stays silent for two more heartbeats, so a dead receiver costs one request instead of
every request dispatched to it until its heartbeats are missed.

A worker is identified by its ROUTER connection, which only a registration carrying the
shared token creates; a report about a request counts only if it comes from the instance
the request's flight names. Anything else is a late or forged message and changes nothing.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import deque

import anyio
import msgspec
import structlog
import zmq
import zmq.asyncio

from actors.base import reply_once, serve_mailbox
from actors.flight import Flight, FlightState
from actors.links import Link, model_problem, registration_problem, work_address_problem
from actors.mail import (
    AdmissionMail,
    Enqueue,
    Failed,
    Farewell,
    Finished,
    Forget,
    FrontendMail,
    HandedOff,
    Job,
    Join,
    Leave,
    LimitsChanged,
    NegotiatorMail,
    Placed,
    PoolMail,
    QueryStats,
    Release,
    Send,
    Stepped,
    Stuck,
    Suspect,
    Tick,
    TrackerMail,
)
from actors.mailbox import Mailbox, MailboxCounts
from actors.slots import SlotBook
from orchestrator.config import DaemonConfig
from transfer.binding import FLUSH_ON_CLOSE_MS, bound_router
from transfer.protocol import (
    DECODE_ERRORS,
    WORKER_MESSAGE,
    Abort,
    Alloc,
    Allocated,
    AllocRejected,
    Done,
    Heartbeat,
    Leaving,
    Probed,
    Push,
    Pushed,
    Ready,
    Reason,
    Register,
    Registered,
    RegisterRefused,
    Role,
    Staged,
    Step,
    Work,
    WorkerMessage,
    WorkOrder,
    encode,
    hop_name,
    next_role,
)
from transfer.reports import REPORTS_PER_MESSAGE
from transfer.sockets import NOBLOCK, PlainPump
from transfer.specs import check_frames

log = structlog.get_logger()

# Silence for this many heartbeat periods makes a worker a suspect, and evicts a receiver a
# push failed to reach (instead of heartbeat_misses). Two: a live worker heartbeats every
# period, busy or not, and one late beat suspects nobody.
SUSPECT_HEARTBEATS = 2


class PreallocCounts(msgspec.Struct, frozen=True):
    free: int
    total: int


class NegotiatorStats(msgspec.Struct, frozen=True):
    prealloc: dict[str, PreallocCounts]
    handoffs_in_flight: int
    fast_path: dict[str, int]
    slow_path: dict[str, int]
    late_reports: int
    mailbox: MailboxCounts


class TransferNegotiator:
    """Owns the worker socket, the receive slots and every request's flight."""

    def __init__(
        self,
        inbox: Mailbox[NegotiatorMail],
        *,
        ctx: zmq.asyncio.Context,
        cfg: DaemonConfig,
        pools: dict[Role, Mailbox[PoolMail]],
        admission: Mailbox[AdmissionMail],
        tracker: Mailbox[TrackerMail],
        frontend: Mailbox[FrontendMail],
    ) -> None:
        self._inbox = inbox
        self._ctx = ctx
        self._cfg = cfg
        self._pools = pools
        self._admission = admission
        self._tracker = tracker
        self._frontend = frontend
        self._sock: zmq.Socket | None = None
        self._links: dict[bytes, Link] = {}
        self._by_instance: dict[str, Link] = {}
        self._slots = SlotBook()
        self._flights: dict[str, Flight] = {}
        self._fast: dict[str, int] = {}
        self._slow: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._late = 0  # reports about requests that had already ended: counted, then dropped
        self._quarantine: deque[tuple[float, Flight]] = deque()  # (release at, doomed flight)
        self._stopping = False  # farewells sent: registrations get no answer
        self._log = log.bind(actor="negotiator")

    async def run(self, *, task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        with bound_router(self._ctx, self._cfg.worker_endpoint, send_hwm=self._cfg.worker_send_hwm,
                          max_message_bytes=self._cfg.worker_max_message_bytes, close_linger_ms=FLUSH_ON_CLOSE_MS,
                          plain=True) as (sock, bound):
            self._sock = sock
            pump = PlainPump(sock, self._on_frames, copy=False, hold=self._inbox.board.hold)
            await serve_mailbox(self._inbox, self._handle, pump=pump.run, task_status=task_status, started=bound)

    # ------------------------------------------------------------------ worker socket

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        """``[routing_id, report, report, ...]``, or ``[routing_id, Done, *its frames]`` (protocol.md §3.2)."""
        if len(frames) < 2:
            return  # a routing frame with no body
        routing_id = frames[0].bytes
        first = self._decode(frames[1])
        if first is None:
            return
        link = self._links.get(routing_id)
        if link is None:
            if self._stopping:
                return  # a worker rejoining the daemon that just said farewell: it retries, and its successor answers
            if isinstance(first, Register):
                self._register(routing_id, first)
            else:
                self._reply(routing_id, RegisterRefused(
                    message="not registered (the daemon restarted or evicted this worker)", rejoin=True))
            return
        link.last_seen = time.monotonic()
        if link.suspect and link.reached:
            self._trust(link)  # it is alive: no longer quiet, and a failed push was not its death
        if isinstance(first, Register):
            return  # a retried Register on a live connection: the first answer stands
        if isinstance(first, Done) and first.outputs:
            self._on_report(link, first, frames[2:])
            return
        if len(frames) > 1 + REPORTS_PER_MESSAGE:
            self._log.warning("worker.too_many_reports", instance=link.instance, reports=len(frames) - 1,
                              read=REPORTS_PER_MESSAGE)
        self._on_report(link, first, [])
        for frame in frames[2 : 1 + REPORTS_PER_MESSAGE]:
            if self._links.get(routing_id) is not link:
                return  # evicted by a report of this message (Leaving): the rest is about nothing
            msg = self._decode(frame)
            if msg is not None:
                self._on_report(link, msg, [])

    def _decode(self, frame: zmq.Frame) -> WorkerMessage | None:
        try:
            return WORKER_MESSAGE.decode(frame.buffer)
        except DECODE_ERRORS as exc:
            self._log.warning("worker.bad_message", error=str(exc))
            return None

    def _reply(self, routing_id: bytes, msg: Registered | RegisterRefused) -> None:
        assert self._sock is not None
        # A ROUTER drops a reply to a peer that is gone or not reading; it never blocks.
        self._sock.send_multipart([routing_id, encode(msg)], flags=NOBLOCK)

    def _register(self, routing_id: bytes, msg: Register) -> None:
        problem = (registration_problem(msg, self._cfg.token) or model_problem(msg, self._links.values())
                   or work_address_problem(self._ctx, msg.work_address))
        if problem is not None:
            self._log.warning("worker.refused", name=msg.name, why=problem)
            self._reply(routing_id, RegisterRefused(message=problem))
            return
        stale = next((old for old in self._links.values() if old.name == msg.name), None)
        if stale is not None:
            # Same name, new connection: a restart, whose old process is dead, or a second
            # live process under the name. One silent for a while is taken for the dead one
            # of a restart, and what it was pushing into is freed at once; one heard from
            # lately may be alive and still pushing, so its writes get their Pushed or the
            # quarantine. The old connection is told to stop, or two live ones would evict
            # each other on every rejoin. (A dead one's connection is gone: the ROUTER drops it.)
            silent = time.monotonic() - stale.last_seen > SUSPECT_HEARTBEATS * self._cfg.heartbeat_s
            self._evict(stale, f"{stale.instance} re-registered as a new process", gone=silent)
            self._reply(stale.routing_id, RegisterRefused(
                message=f"another worker registered under the name {msg.name!r}: worker names must be unique"))
        instance = f"{msg.role}-{next(self._ids)}"
        now = time.monotonic()
        link = Link(routing_id, instance, msg.role, msg.name, msg.session, msg.pool_base, msg.pool_size,
                    msg.work_address, joined_at=now, last_seen=now, local=msg.local, model=msg.limits.model,
                    model_digest=msg.model_digest)
        self._links[routing_id] = link
        self._by_instance[instance] = link
        if msg.role != "encoder":
            self._slots.add_instance(instance, msg.slots)
        key = secrets.token_bytes(16)
        self._pools[msg.role].post(Join(instance=instance, name=msg.name, work_address=msg.work_address,
                                         session=msg.session, key=key, capacity=msg.capacity))
        self._frontend.post(LimitsChanged(role=msg.role, instance=instance, limits=msg.limits))
        self._reply(routing_id, Registered(instance=instance, key=key, heartbeat_s=self._cfg.heartbeat_s))
        self._log.info("worker.registered", instance=instance, name=msg.name, role=msg.role,
                       session=msg.session, slots=[s.size for s in msg.slots], capacity=msg.capacity)

    # ------------------------------------------------------------------ reports

    def _on_report(self, link: Link, msg: WorkerMessage, frames: list[zmq.Frame]) -> None:
        match msg:
            case Heartbeat():
                pass
            case Probed(instance=instance):
                if instance == link.instance and not link.reached:
                    link.reached = True
                    self._trust(link)  # the pool offers it work from now on
            case Leaving():
                # Sent after its threads ended: no write of its is in flight (gone=True).
                self._evict(link, f"{link.instance} left: its process is stopping")
            case Staged():
                self._staged(link, msg)
            case Allocated():
                self._allocated(link, msg)
            case AllocRejected(request_id=rid, message=message):
                flight = self._flights.get(rid)
                if flight is None or flight.state != FlightState.ALLOCATING or flight.receiver != link.instance:
                    self._late += 1
                    return
                self._fail(flight, Reason.TRANSFER_FAILED, f"{link.instance} cannot fit {flight.nbytes} bytes: {message}")
            case Pushed():
                self._pushed(link, msg)
            case Done():
                self._done(link, msg, frames)
            case Step(request_id=rid, step=step, steps=steps):
                flight = self._flights.get(rid)
                if flight is None or flight.state != FlightState.RUNNING or flight.instance != link.instance:
                    self._late += 1
                    return
                self._tracker.post(Stepped(request_id=rid, step=step, steps=steps))
            case Register():
                pass  # only a message's first report registers

    def _staged(self, link: Link, msg: Staged) -> None:
        rid = msg.request_id
        flight = self._flights.get(rid)
        if flight is None or flight.state != FlightState.RUNNING or flight.instance != link.instance:
            self._free_late(link, rid, flight)  # late (the request ended), repeated, or not its to report
            return
        following = next_role(link.role)
        bad = [s.name for s in msg.manifest if s.offset + s.nbytes > msg.nbytes]
        if following is None or bad:
            self._fail(flight, Reason.STAGE_FAILED, f"{link.instance} staged an invalid output {bad}", outcome=False)
            return
        self._recycle_input(flight)
        flight.stage_output(msg.nbytes, msg.manifest, msg.compute_ms)
        self._admission.post(Enqueue(job=Job(request_id=rid, role=following, params=flight.params,
                                             priority=flight.priority, progress=flight.progress)))

    def _free_late(self, link: Link, rid: str, flight: Flight | None) -> None:
        """A late report says ``link`` holds memory for ``rid``: have it freed there, unless the
        request is live on that worker (a repeated report), where the memory is in use.

        A doomed flight's sender may be aborted again (an abort never frees a block that is
        being pushed), but not its receiver: that would free an allocation a write may still
        land in. The receiver is aborted when its memory is released.
        """
        self._late += 1
        involved = flight is not None and link.instance in (flight.instance, flight.receiver)
        if not involved or (flight.doomed and link.instance == flight.instance):
            self._order(link.role, link.instance, Abort(request_id=rid))
        elif flight.doomed:
            flight.abort_receiver = True

    def _placed(self, job: Job, instance: str) -> None:
        rid = job.request_id
        if job.role == "encoder":
            self._flights[rid] = Flight(request_id=rid, params=job.params, role="encoder", instance=instance,
                                        priority=job.priority, progress=job.progress)
            self._order("encoder", instance, Work(request_id=rid, params=job.params, progress=job.progress))
            return
        flight = self._flights.get(rid)
        if flight is None or flight.state != FlightState.AWAITING:
            # Ended while queued: its Forget may have reached the pool before this dispatch
            # did, so the slot just reserved would never be freed: hand it back here. (Not a
            # Forget: the request's own already went round, and a second would abort its
            # workers again.)
            self._pools[job.role].post(Release(request_id=rid, instance=instance, ok=None))
            return
        hop = hop_name(flight.role, job.role)
        slot = self._slots.take(instance, flight.nbytes)
        if slot is not None:
            self._fast[hop] = self._fast.get(hop, 0) + 1
            flight.reserve(instance, job.role, slot=slot, address=slot.address)
            self._push(flight)
        else:
            self._slow[hop] = self._slow.get(hop, 0) + 1
            flight.reserve(instance, job.role, slot=None, address=None)
            self._order(job.role, instance, Alloc(request_id=rid, nbytes=flight.nbytes))

    def _allocated(self, link: Link, msg: Allocated) -> None:
        flight = self._flights.get(msg.request_id)
        if flight is None or flight.state != FlightState.ALLOCATING or flight.receiver != link.instance:
            self._free_late(link, msg.request_id, flight)  # the request ended while it allocated, or repeated
            return
        if not link.holds(msg.address, flight.nbytes):
            self._fail(flight, Reason.TRANSFER_FAILED, f"{link.instance} allocated outside its pool")
            return
        flight.allocated(msg.address)
        self._push(flight)

    def _push(self, flight: Flight) -> None:
        receiver, sender = self._by_instance[flight.receiver], self._by_instance[flight.instance]
        # Two workers of one kernel: the sender may copy into the receiver's shared pool.
        same_host = receiver.local is not None and sender.local is not None and receiver.local.host == sender.local.host
        self._order(flight.role, flight.instance, Push(request_id=flight.request_id, session=receiver.session,
                                                       address=flight.address, nbytes=flight.nbytes,
                                                       local=receiver.local if same_host else None))

    def _pushed(self, link: Link, msg: Pushed) -> None:
        flight = self._flights.get(msg.request_id)
        if flight is None or flight.state != FlightState.PUSHING or flight.instance != link.instance:
            self._late += 1
            return
        rid = flight.request_id
        if flight.doomed:
            # The request ended mid-push; only now is the receiver's memory safe to reuse.
            self._release_receiver(flight)
            del self._flights[rid]
            return
        if not msg.ok:
            receiver = self._by_instance.get(flight.receiver or "")
            if receiver is not None and receiver.push_failed_at is None:
                receiver.push_failed_at = time.monotonic()
                self._suspect(receiver)
            # A push that ended in failure wrote nothing more: the receiver's memory is free at
            # once. One in doubt (timed out) may still land: that memory waits out the quarantine.
            self._fail(flight, Reason.TRANSFER_FAILED, f"{flight.instance} -> {flight.receiver}: {msg.error}",
                       outcome=False, pushing=msg.in_doubt)
            return
        self._pools[flight.role].post(Release(request_id=rid, instance=flight.instance, ok=True))
        self._tracker.post(HandedOff(request_id=rid, role=flight.role, instance=flight.instance,
                                      compute_ms=flight.compute_ms, transfer_ms=msg.transfer_ms,
                                      nbytes=flight.nbytes, fast_path=flight.slot is not None, via=msg.via))
        ready = Ready(request_id=rid, params=flight.params, address=flight.address, manifest=flight.manifest,
                      slot_id=flight.slot.slot_id if flight.slot else None, progress=flight.progress)
        flight.delivered()
        self._order(flight.role, flight.instance, ready)

    def _done(self, link: Link, msg: Done, frames: list[zmq.Frame]) -> None:
        flight = self._flights.get(msg.request_id)
        if flight is None or flight.state != FlightState.RUNNING or flight.instance != link.instance:
            self._late += 1
            return
        rid = flight.request_id
        if not msg.ok:
            self._fail(flight, msg.reason, f"{link.instance}: {msg.error}", outcome=False)
            return
        if link.role != "decoder":
            self._fail(flight, Reason.STAGE_FAILED, f"{link.instance} ({link.role}) answered Done; only decoders do",
                       outcome=False)
            return
        try:
            check_frames(msg.outputs, frames)
        except ValueError as exc:
            self._fail(flight, Reason.STAGE_FAILED, f"{link.instance} sent outputs unlike their headers: {exc}",
                       outcome=False)
            return
        self._recycle_input(flight)
        del self._flights[rid]
        self._pools[link.role].post(Release(request_id=rid, instance=link.instance, ok=True))
        self._tracker.post(Finished(request_id=rid, instance=link.instance, compute_ms=msg.compute_ms,
                                     outputs=msg.outputs, frames=frames))

    # ------------------------------------------------------------------ mail

    def _handle(self, mail: NegotiatorMail) -> None:
        match mail:
            case Placed(job=job, instance=instance):
                self._placed(job, instance)
            case Forget(request_id=rid):
                flight = self._flights.get(rid)
                if flight is not None and not flight.doomed:
                    self._end(flight, pushing=flight.state == FlightState.PUSHING)
            case Tick():
                self._check_liveness(time.monotonic())
            case Farewell():
                self._farewell()
            case Stuck(instance=instance, message=message):
                link = self._by_instance.get(instance)
                if link is not None:  # later flushes to it say so again until its Leave lands
                    self._evict(link, message, gone=False)
            case QueryStats(reply=reply):
                prealloc = {}
                for instance in self._by_instance:
                    free, total = self._slots.counts(instance)
                    prealloc[instance] = PreallocCounts(free, total)
                in_flight = sum(1 for f in self._flights.values() if f.state != FlightState.RUNNING)
                reply_once(reply, NegotiatorStats(prealloc, in_flight, dict(self._fast), dict(self._slow),
                                                  self._late, self._inbox.counts()))
            case _:
                raise AssertionError(f"unexpected mail {mail!r}")

    def _farewell(self) -> None:
        """Tell every worker the daemon stops, to rejoin its successor; ``settled`` for each
        that no flight still names as receiver, so no write ordered here can land in its
        memory later and it need not wait out push_quarantine_s when it rejoins."""
        receiving = {flight.receiver for flight in self._flights.values() if flight.receiver is not None}
        for link in self._links.values():
            self._reply(link.routing_id, RegisterRefused(message="the daemon is stopping", rejoin=True,
                                                         settled=link.instance not in receiving))
        self._stopping = True
        self._log.info("negotiator.farewell", workers=len(self._links), unsettled=len(receiving))

    def _end(self, flight: Flight, *, pushing: bool, outcome: bool | None = None) -> None:
        """Free everything ``flight`` holds, as soon as each piece is safe to free.

        The negotiator alone decides when a placed request lets go: the pool slots of its
        current instance and of a reserved receiver, the worker state (an abort), and the
        receiver's memory. ``pushing`` means a write into that memory may be in progress,
        so the memory stays reserved until the push reports. ``outcome`` is how the
        current instance's stage ended (None: the request ended elsewhere).
        """
        rid = flight.request_id
        self._pools[flight.role].post(Release(request_id=rid, instance=flight.instance, ok=outcome))
        self._order(flight.role, flight.instance, Abort(request_id=rid))
        self._recycle_input(flight)
        if flight.receiver is not None:
            self._pools[flight.receiver_role].post(Release(request_id=rid, instance=flight.receiver, ok=None))
            if pushing:
                # Normally the sender's Pushed releases it; the quarantine bounds the wait
                # should that report never come.
                flight.doomed = True
                self._quarantine.append((time.monotonic() + self._cfg.push_quarantine_s, flight))
                return
            self._release_receiver(flight)
        del self._flights[rid]

    def _fail(self, flight: Flight, reason: Reason, message: str, *, pushing: bool = False,
              outcome: bool | None = None) -> None:
        """End ``flight`` here and now, and tell the tracker why."""
        self._end(flight, pushing=pushing, outcome=outcome)
        self._tracker.post(Failed(request_id=flight.request_id, reason=reason, message=message))

    def _release_receiver(self, flight: Flight) -> None:
        if flight.slot is not None:
            self._slots.recycle(flight.slot)
        if flight.slot is None or flight.abort_receiver:
            self._order(flight.receiver_role, flight.receiver, Abort(request_id=flight.request_id))

    def _recycle_input(self, flight: Flight) -> None:
        if flight.input_slot is not None:
            self._slots.recycle(flight.input_slot)
            flight.input_slot = None

    def _order(self, role: Role, instance: str | None, order: WorkOrder) -> None:
        assert instance is not None
        self._pools[role].post(Send(instance=instance, order=order))

    # ------------------------------------------------------------------ liveness

    def _suspect(self, link: Link) -> None:
        """No new work for ``link`` until it is heard from."""
        if not link.suspect:
            link.suspect = True
            self._pools[link.role].post(Suspect(instance=link.instance, suspect=True))

    def _trust(self, link: Link) -> None:
        link.suspect, link.push_failed_at = False, None
        self._pools[link.role].post(Suspect(instance=link.instance, suspect=False))

    def _check_liveness(self, now: float) -> None:
        heartbeat_s = self._cfg.heartbeat_s
        limit = heartbeat_s * self._cfg.heartbeat_misses
        for link in list(self._links.values()):
            silent_s = now - link.last_seen
            if silent_s > limit:
                self._evict(link, f"{link.instance} missed heartbeats for {silent_s:.1f}s", gone=False)
            elif link.push_failed_at is not None and now - link.push_failed_at > SUSPECT_HEARTBEATS * heartbeat_s:
                self._evict(link, f"{link.instance} went silent after a push into it failed "
                                  f"(last heard {silent_s:.1f}s ago)", gone=False)
            elif not link.reached and now - link.joined_at > limit and silent_s <= SUSPECT_HEARTBEATS * heartbeat_s:
                # It still speaks, so it is alive and its DEALER gets through: only the way
                # to its work socket is wrong. (A silent one is evicted as any silent one.)
                self._refuse_unreached(link, limit)
            elif silent_s > SUSPECT_HEARTBEATS * heartbeat_s:
                self._suspect(link)  # quiet: dead, frozen or cut off, work sent now would wait
        while self._quarantine and self._quarantine[0][0] <= now:
            _, flight = self._quarantine.popleft()
            if self._flights.get(flight.request_id) is flight:  # not already released by its Pushed
                self._release_receiver(flight)
                del self._flights[flight.request_id]

    def _refuse_unreached(self, link: Link, limit_s: float) -> None:
        """Drop a worker whose work socket the daemon cannot reach, and tell it why: it was
        never offered work, and registering again would change nothing."""
        why = (f"the daemon's orders to work_address {link.work_address} did not arrive within {limit_s:.1f}s: "
               f"the worker's advertise_host (or its firewall) does not let the daemon reach it")
        self._evict(link, f"{link.instance}: {why}")
        self._reply(link.routing_id, RegisterRefused(message=why))

    def _evict(self, link: Link, why: str, *, gone: bool = True) -> None:
        """Forget a worker. ``gone``: no write of its can still land (it said Leaving after
        its threads ended, or it never got work); otherwise it may yet finish one."""
        del self._links[link.routing_id]
        del self._by_instance[link.instance]
        self._slots.remove_instance(link.instance)
        self._pools[link.role].post(Leave(instance=link.instance, reason=Reason.WORKER_LOST, message=why))
        self._frontend.post(LimitsChanged(role=link.role, instance=link.instance, limits=None))
        # Eviction is rare, so a pass over the flights is fine here (never on the hot path).
        for flight in [f for f in self._flights.values() if link.instance in (f.instance, f.receiver)]:
            sender_lost = flight.state == FlightState.PUSHING and flight.instance == link.instance
            if not flight.doomed:
                self._fail(flight, Reason.WORKER_LOST, why, pushing=flight.state == FlightState.PUSHING)
            if sender_lost and gone:
                # A dead sender writes nothing more: the receiver's memory is free at once.
                self._release_receiver(flight)
                self._flights.pop(flight.request_id, None)
            # A silent sender may wake and finish its write: its flight stays doomed until
            # the quarantine (set when it was doomed) ends, past Mooncake's transfer timeout.
        self._log.warning("worker.evicted", instance=link.instance, why=why)
