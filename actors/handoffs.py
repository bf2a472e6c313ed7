"""Handoffs: every request's flight between stages, and the receive slots it lands in.

One ``Flight`` per request, from the moment a stage starts it until the decoder answers.
Per hop it takes the fast path (a free preallocated slot big enough: tell the sender to
push at once) or the slow path (ask the receiver to allocate, then push). It decides alone
when a request lets go of what it holds at each worker: its pool slots, its worker state
(an abort) and the receiver's memory, which stays reserved while a write may still land
in it (until the sender's Pushed, or push_quarantine_s).

Owned by the ``TransferNegotiator`` actor, which feeds it the reports of registered
workers (``link`` is the worker that sent one) and the mail about placements and ends. A
report counts only if it comes from the instance the request's flight names; anything else
is late or forged, is counted, and changes nothing (memory a late report says is held is
freed at its worker).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import zmq

from actors.flight import Flight, FlightState
from actors.links import Link
from actors.mail import (
    AdmissionMail,
    Enqueue,
    Failed,
    Finished,
    HandedOff,
    Job,
    PoolMail,
    Release,
    RunEnded,
    Send,
    Stepped,
    TrackerMail,
)
from actors.mailbox import Mailbox
from actors.slots import Slot, SlotBook
from transfer.engine import write_limit_s
from transfer.protocol import (
    STAGE_REASONS,
    Abort,
    Alloc,
    Allocated,
    AllocRejected,
    Done,
    Push,
    Pushed,
    Ready,
    Reason,
    Role,
    SlotInfo,
    Staged,
    Step,
    Stopped,
    Work,
    WorkOrder,
    hop_name,
    next_role,
)
from transfer.specs import ALIGNMENT, align_up, check_frames

log = structlog.get_logger()


# A sender reports a write by its own deadline (transfer.engine.write_limit_s), done, failed
# or in doubt; the report's way here gets this much more.
PUSH_REPORT_GRACE_S = 1.0
# How many times one hand-off's Push goes again after its sender refused it for a stall
# (Pushed(stood_still)). An honest sender refuses one only after a real stall; one that
# refuses each (frozen over and over, or broken) would otherwise be sent the Push in a loop
# until the request's deadline: the hand-off fails transfer_failed instead, retried elsewhere.
STALLED_PUSHES_MAX = 3


@dataclass(frozen=True, slots=True)
class Room:
    """What one receiver can take in one hand-off, as its pool carves its memory
    (transfer/pool.py): the preallocated slots from the pool's start, each taking whole
    alignment units, and the general region after them trimmed to whole units."""

    region: int
    largest_slot: int

    @classmethod
    def of(cls, link: Link, slots: list[SlotInfo]) -> Room:
        slots_end = max((s.address + s.size for s in slots), default=link.pool_base)
        region = max(link.pool_size - align_up(slots_end - link.pool_base), 0) // ALIGNMENT * ALIGNMENT
        return cls(region, max((s.size for s in slots), default=0))

    @property
    def largest_fit(self) -> int:
        """The most it could ever take in one hand-off."""
        return max(self.region, self.largest_slot)

    def only_a_slot_fits(self, nbytes: int) -> bool:
        return self.region < nbytes <= self.largest_slot


class Handoffs:
    """Owns every flight, every receiver's preallocated slots, and the hand-off counters."""

    def __init__(
        self,
        *,
        links: dict[str, Link],
        push_quarantine_s: float,
        pools: dict[Role, Mailbox[PoolMail]],
        admission: Mailbox[AdmissionMail],
        tracker: Mailbox[TrackerMail],
        push_failed_into: Callable[[Link], None],
    ) -> None:
        self._links = links  # the negotiator's registered workers, by instance (read here)
        self._push_quarantine_s = push_quarantine_s
        self._pools = pools
        self._admission = admission
        self._tracker = tracker
        self._push_failed_into = push_failed_into  # a receiver a write could not reach
        self._slots = SlotBook()
        self._rooms: dict[str, Room] = {}  # receiver -> what it takes
        # role -> the most any of its receivers registered in this daemon's life takes. One that
        # left may be restarting: an output only it takes waits for it (in the receivers'
        # pool, until its deadline) rather than fail as no receiver's, which a big receiver's
        # restart made of every such request. Only what none ever took fails at once.
        self._largest: dict[Role, int] = {}
        # Per receiver, its line: the flights in SLOT_WAIT there, first come first served (a
        # large output is never starved by smaller ones). A flight leaves it when it ends.
        self._slot_waits: dict[str, deque[Flight]] = {}
        self._flights: dict[str, Flight] = {}
        self.fast: dict[str, int] = {}  # hand-offs made, by hop
        self.slow: dict[str, int] = {}
        self.late = 0  # reports late, repeated or not the sender's to make (_late): counted, then dropped
        # (release at, request id) of doomed flights. Ids, not flights: one released by its
        # Pushed meanwhile (most are) is gone at once, prompts and all, not push_quarantine_s later.
        self._quarantine: deque[tuple[float, str]] = deque()
        # Flights whose Push went out and whose sender has not reported it.
        self._pushing: dict[str, Flight] = {}
        self._acks = itertools.count(1)  # for the Aborts of running stages, answered by Stopped

    # ------------------------------------------------------------------ workers

    def add_receiver(self, link: Link, slots: list[SlotInfo]) -> int:
        """Book ``link``'s memory; returns the most it can take in one hand-off."""
        self._slots.add_instance(link.instance, slots)
        room = Room.of(link, slots)
        self._rooms[link.instance] = room
        self._largest[link.role] = max(self._largest.get(link.role, 0), room.largest_fit)
        return room.largest_fit

    def worker_lost(self, link: Link, why: str, *, gone: bool) -> None:
        """End every flight ``link`` takes part in. ``gone``: no write of its can still land."""
        self._slots.remove_instance(link.instance)
        self._slot_waits.pop(link.instance, None)  # its flights fail below
        self._rooms.pop(link.instance, None)
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

    def receivers(self) -> set[str]:
        """Every instance a flight names as receiver: a write may yet land in its memory."""
        return {flight.receiver for flight in self._flights.values() if flight.receiver is not None}

    def prealloc_counts(self, instance: str) -> tuple[int, int]:
        """(free, total) preallocated slots of ``instance``."""
        return self._slots.counts(instance)

    def in_flight(self) -> int:
        """Hand-offs under way: flights of live requests between two stages."""
        return sum(1 for f in self._flights.values() if f.state != FlightState.RUNNING and not f.doomed)

    def held(self) -> int:
        """Hand-offs of ended requests whose receiver's memory waits for the push to report
        (or for push_quarantine_s): a write may still land in it."""
        return sum(1 for f in self._flights.values() if f.doomed)

    # ------------------------------------------------------------------ mail

    def placed(self, job: Job, instance: str) -> None:
        rid = job.request_id
        if job.role == "encoder":
            self._flights[rid] = Flight(request_id=rid, params=job.params, role="encoder", instance=instance,
                                        deadline=job.deadline, priority=job.priority, progress=job.progress,
                                        avoid=job.avoid, again=job.again)
            self._order("encoder", instance, Work(request_id=rid, params=job.params, progress=job.progress,
                                                  priority=job.priority))
            return
        flight = self._flights.get(rid)
        if flight is None or flight.state != FlightState.AWAITING:
            # Ended while queued: its Forget may have reached the pool before this dispatch
            # did, so the slot just reserved would never be freed: hand it back here. (Not a
            # Forget: the request's own already went round, and a second would abort its
            # workers again.)
            self._pools[job.role].post(Release(request_id=rid, instance=instance, ok=None))
            return
        # A free slot is not taken past the flights waiting there: the first of them needs a
        # larger one, which would otherwise go to every smaller input that comes after it.
        slot = None if self._slot_waits.get(instance) else self._slots.take(instance, flight.nbytes)
        room = self._rooms.get(instance)  # None: evicted since its pool placed this
        now = time.monotonic()
        if slot is not None:
            flight.reserve(instance, slot=slot, address=slot.address, at=now)
            self._push(flight)
        elif room is not None and room.only_a_slot_fits(flight.nbytes):
            # Asking it to allocate would be refused (its region is too small) and fail the
            # request; its slots free as the requests it holds move on.
            flight.wait_for_slot(instance)
            self._slot_waits.setdefault(instance, deque()).append(flight)
        else:
            flight.reserve(instance, slot=None, address=None, at=now)
            self._order(job.role, instance, Alloc(request_id=rid, nbytes=flight.nbytes))

    def forget(self, rid: str) -> None:
        """The request ended elsewhere (failed, timed out, cancelled)."""
        flight = self._flights.get(rid)
        if flight is not None and not flight.doomed:
            self._end(flight, pushing=flight.state == FlightState.PUSHING)

    def late_senders(self, now: float) -> set[str]:
        """Senders with a push unreported past its due time. Their push path is stuck (a
        write waits on a peer that does not answer, Mooncake's handshake with a frozen one
        for a minute), and their writes go one at a time: work sent there would wait too.
        Every push is looked at: each sender's are due by its own write timeout, so sending
        order is not due order (the pushes in flight are few: at most one per request a receiver holds)."""
        late: set[str] = set()
        ended: list[str] = []
        for rid, flight in self._pushing.items():
            if self._flights.get(rid) is not flight or flight.state != FlightState.PUSHING:
                ended.append(rid)  # without its Pushed: its sender left, or its quarantine ran out
            elif flight.push_due <= now:
                late.add(flight.instance)
        for rid in ended:
            del self._pushing[rid]
        return late

    def postpone_pushes(self, stalled_s: float) -> None:
        """The daemon stood still: the reports of that time wait unread in its socket."""
        for flight in self._pushing.values():
            flight.push_due += stalled_s

    def expire_quarantine(self, now: float) -> None:
        while self._quarantine and self._quarantine[0][0] <= now:
            ends, rid = self._quarantine.popleft()
            # Not already released by its Pushed, nor quarantined anew (a push in doubt), nor
            # a later request under the same id.
            flight = self._flights.get(rid)
            if flight is not None and flight.doomed and flight.quarantine_ends == ends:
                self._release_receiver(flight)
                del self._flights[rid]

    def _start_quarantine(self, flight: Flight) -> None:
        """Hold the doomed ``flight``'s receiver memory for push_quarantine_s from now."""
        flight.quarantine_ends = time.monotonic() + self._push_quarantine_s
        self._quarantine.append((flight.quarantine_ends, flight.request_id))  # in order: every wait is as long

    # ------------------------------------------------------------------ reports

    def staged(self, link: Link, msg: Staged) -> None:
        rid = msg.request_id
        flight = self._reported(rid, FlightState.RUNNING, link)
        if flight is None:
            self._free_late(link, msg)
            return
        following = next_role(link.role)
        # Without its digest a tensor's copy goes unchecked at the receiver, which would then
        # serve whatever a late write left in that memory (docs/protocol.md §4.4).
        bad = [s.name for s in msg.manifest if s.offset + s.nbytes > msg.nbytes or s.xxh3 is None]
        if following is None or bad:
            self._fail(flight, Reason.STAGE_FAILED, f"{link.instance} staged an invalid output {bad} (past its "
                                                    "block, without its digest, or from the decoder)", outcome=False)
            return
        largest = self._largest.get(following)  # None: no receiver yet, so the request waits for one
        if largest is not None and msg.nbytes > largest:
            # Retrying would only compute it again: no receiver ever registered can take it.
            self._fail(flight, Reason.INVALID, f"its {msg.nbytes}-byte output fits no {following}'s memory pool "
                                               f"(the most one ever registered takes is {largest} bytes: "
                                               f"workers.{following}.pool_bytes past its preallocated slots, "
                                               "or prealloc_slot_bytes)", outcome=True)
            return
        self._recycle_input(flight)
        flight.stage_output(msg.nbytes, msg.manifest, msg.compute_ms, at=time.monotonic())
        self._admission.post(Enqueue(job=Job(request_id=rid, role=following, params=flight.params,
                                             deadline=flight.deadline, priority=flight.priority,
                                             progress=flight.progress, avoid=flight.avoid, again=flight.again,
                                             nbytes=msg.nbytes)))

    def allocated(self, link: Link, msg: Allocated) -> None:
        flight = self._reported(msg.request_id, FlightState.ALLOCATING, link, by_receiver=True)
        if flight is None:
            self._free_late(link, msg)
            return
        if not link.holds(msg.address, flight.nbytes):
            self._fail(flight, Reason.TRANSFER_FAILED, f"{link.instance} allocated outside its pool")
            return
        flight.allocated(msg.address)
        self._push(flight)

    def alloc_rejected(self, link: Link, msg: AllocRejected) -> None:
        flight = self._reported(msg.request_id, FlightState.ALLOCATING, link, by_receiver=True)
        if flight is None:
            self._late(link, msg)
            return
        self._fail(flight, Reason.TRANSFER_FAILED, f"{link.instance} cannot fit {flight.nbytes} bytes: {msg.message}")

    def pushed(self, link: Link, msg: Pushed) -> None:
        flight = self._reported(msg.request_id, FlightState.PUSHING, link)
        if flight is None:
            if msg.stood_still:  # it kept its output for a Push that will not come: free it
                self._free_late(link, msg)
            else:
                self._late(link, msg)
            return
        if self._pushing.get(flight.request_id) is flight:
            del self._pushing[flight.request_id]
        if flight.in_doubt:
            self._late(link, msg)  # its push has reported already: a repeat
        elif msg.stood_still:
            self._push_stood_still(link, flight)
        elif flight.doomed:
            self._pushed_after_end(flight, msg)
        elif not msg.ok:
            self._push_failed(flight, msg)
        else:
            self._handed_over(flight, msg)

    def _push_stood_still(self, link: Link, flight: Flight) -> None:
        """The sender wrote nothing, its output still staged: while the request lives, the
        receiver's memory is still its own, so the push goes again, fresh by then; else both
        ends are freed."""
        flight.stalled_pushes += 1
        if flight.doomed:
            self._order(flight.role, flight.instance, Abort(request_id=flight.request_id))
            self._release_receiver(flight)
            del self._flights[flight.request_id]
        elif flight.stalled_pushes > STALLED_PUSHES_MAX:
            self._fail(flight, Reason.TRANSFER_FAILED, f"{link.instance} stood still at each of "
                       f"{flight.stalled_pushes} pushes of its output and wrote none")
        else:
            self._push(flight, after_stall=True)

    def _pushed_after_end(self, flight: Flight, msg: Pushed) -> None:
        """The request ended mid-push. A push that ended wrote all it will: only now is the
        receiver's memory safe to reuse. One in doubt (timed out) may still land: that memory
        waits out a quarantine from now."""
        if msg.in_doubt:
            flight.in_doubt = True
            self._start_quarantine(flight)
            return
        self._release_receiver(flight)
        del self._flights[flight.request_id]

    def _push_failed(self, flight: Flight, msg: Pushed) -> None:
        """A push that ended in failure wrote nothing more: the receiver's memory is free at
        once. One in doubt (timed out) may still land: that memory waits out the quarantine."""
        receiver = self._links.get(flight.receiver or "")
        if receiver is not None:
            self._push_failed_into(receiver)
        flight.in_doubt = msg.in_doubt
        self._fail(flight, Reason.TRANSFER_FAILED, f"{flight.instance} -> {flight.receiver}: {msg.error}",
                   outcome=False, pushing=msg.in_doubt)

    def _handed_over(self, flight: Flight, msg: Pushed) -> None:
        rid = flight.request_id
        self._pools[flight.role].post(Release(request_id=rid, instance=flight.instance, ok=True))
        # Counted once it happened: a receiver reserved for a push that then failed, timed
        # out or was never made is no hand-off (the latency and bytes count only these too).
        counts = self.fast if flight.slot is not None else self.slow
        hop = hop_name(flight.role, flight.receiver_role)
        counts[hop] = counts.get(hop, 0) + 1
        self._tracker.post(HandedOff(request_id=rid, role=flight.role, instance=flight.instance,
                                      compute_ms=flight.compute_ms, transfer_ms=msg.transfer_ms,
                                      nbytes=flight.nbytes, fast_path=flight.slot is not None, via=msg.via,
                                      waited_ms=flight.waited_ms))
        ready = Ready(request_id=rid, params=flight.params, address=flight.address, manifest=flight.manifest,
                      slot_id=flight.slot.slot_id if flight.slot else None, progress=flight.progress,
                      priority=flight.priority)
        flight.delivered()
        self._order(flight.role, flight.instance, ready)

    def done(self, link: Link, msg: Done, frames: list[zmq.Frame]) -> None:
        flight = self._reported(msg.request_id, FlightState.RUNNING, link)
        if flight is None:
            self._late(link, msg)
            return
        rid = flight.request_id
        if not msg.ok:
            reason = msg.reason if msg.reason in STAGE_REASONS else Reason.STAGE_FAILED
            self._fail(flight, reason, f"{link.instance}: {msg.error}", outcome=False)
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

    def step(self, link: Link, msg: Step) -> None:
        flight = self._reported(msg.request_id, FlightState.RUNNING, link)
        if flight is None:
            self._late(link, msg)
            return
        self._tracker.post(Stepped(request_id=msg.request_id, step=msg.step, steps=msg.steps))

    def stopped(self, link: Link, msg: Stopped) -> None:
        """A run an Abort stopped at ``link`` is over: the slot it held is free."""
        if link.finishing.get(msg.ack) == msg.request_id:
            del link.finishing[msg.ack]
            self._pools[link.role].post(RunEnded(instance=link.instance))
        else:
            self._late(link, msg)  # not an ack this worker owes: repeated or forged

    # ------------------------------------------------------------------ ends

    def _end(self, flight: Flight, *, pushing: bool, outcome: bool | None = None) -> None:
        """Free everything ``flight`` holds, as soon as each piece is safe to free.

        The negotiator alone decides when a placed request lets go: the pool slots of its
        current instance and of a reserved receiver, the worker state (an abort), and the
        receiver's memory. ``pushing`` means a write into that memory may be in progress,
        so the memory stays reserved until the push reports. ``outcome`` is how the
        current instance's stage ended (None: the request ended elsewhere).
        """
        rid = flight.request_id
        ack = None
        running = self._links.get(flight.instance) if flight.state == FlightState.RUNNING and outcome is None else None
        if running is not None:
            # Its stage may compute on (a pass cannot stop early, a loop stops at its next
            # step): the slot stays taken until the worker answers this Abort's ack.
            ack = next(self._acks)
            running.finishing[ack] = rid
        self._pools[flight.role].post(Release(request_id=rid, instance=flight.instance, ok=outcome,
                                              finishing=ack is not None))
        self._order(flight.role, flight.instance, Abort(request_id=rid, ack=ack))
        self._recycle_input(flight)
        if flight.receiver is not None:
            self._pools[flight.receiver_role].post(Release(request_id=rid, instance=flight.receiver, ok=None))
            if pushing:
                # Normally the sender's Pushed releases it; the quarantine bounds the wait
                # should that report never come.
                flight.doomed = True
                self._start_quarantine(flight)
                return
            self._release_receiver(flight)
        del self._flights[rid]

    def _fail(self, flight: Flight, reason: Reason, message: str, *, pushing: bool = False,
              outcome: bool | None = None) -> None:
        """End ``flight`` here and now, and tell the tracker why."""
        self._end(flight, pushing=pushing, outcome=outcome)
        implicated = frozenset(i for i in (flight.instance, flight.receiver) if i is not None)
        self._tracker.post(Failed(request_id=flight.request_id, reason=reason, message=message, avoid=implicated))

    def _release_receiver(self, flight: Flight) -> None:
        if flight.state == FlightState.SLOT_WAIT:
            # It holds nothing there yet; those behind it in line may fit what is free.
            receiver = flight.receiver
            assert receiver is not None
            line = self._slot_waits.get(receiver)
            if line is not None:  # None: the receiver itself is lost
                line.remove(flight)
                self._serve_line(receiver)
            return
        if flight.slot is not None:
            self._give_back(flight.slot)
        if flight.slot is None or flight.abort_receiver:
            self._order(flight.receiver_role, flight.receiver, Abort(request_id=flight.request_id))

    def _recycle_input(self, flight: Flight) -> None:
        if flight.input_slot is not None:
            self._give_back(flight.input_slot)
            flight.input_slot = None

    def _give_back(self, slot: Slot) -> None:
        self._slots.recycle(slot)
        self._serve_line(slot.instance)

    def _serve_line(self, receiver: str) -> None:
        """Push into ``receiver``'s free slots for the flights in its line, in order."""
        line = self._slot_waits.get(receiver)
        while line:
            flight = line[0]
            if flight.instance not in self._links:
                return  # its sender is being evicted: its end, next, serves the line again
            taken = self._slots.take(receiver, flight.nbytes)
            if taken is None:
                return  # the first in line needs a larger slot than any free
            line.popleft()
            flight.take_slot(taken, at=time.monotonic())
            self._push(flight)

    def _reported(self, rid: str, state: FlightState, link: Link, *, by_receiver: bool = False) -> Flight | None:
        """The flight of ``rid`` if it is in ``state`` and ``link`` is the instance that reports
        on it there (its sender, or with ``by_receiver`` its receiver); None for a report that
        is late (the request ended), repeated, or not that worker's to make."""
        flight = self._flights.get(rid)
        if flight is None or flight.state != state:
            return None
        return flight if (flight.receiver if by_receiver else flight.instance) == link.instance else None

    def _late(self, link: Link, msg: Staged | Allocated | AllocRejected | Pushed | Done | Step | Stopped) -> None:
        """Count ``msg`` as late (or not ``link``'s to make), and say so to a debug log."""
        self.late += 1
        log.debug("worker.late_report", report=type(msg).__name__, request_id=msg.request_id,
                  instance=link.instance)

    def _free_late(self, link: Link, msg: Staged | Allocated | Pushed) -> None:
        """A late report says ``link`` holds memory for its request: have it freed there, unless
        the request is live on that worker (a repeated report), where the memory is in use.

        A doomed flight's sender may be aborted again (an abort never frees a block that is
        being pushed), but not its receiver: that would free an allocation a write may still
        land in. The receiver is aborted when its memory is released.
        """
        self._late(link, msg)
        rid = msg.request_id
        flight = self._flights.get(rid)
        involved = flight is not None and link.instance in (flight.instance, flight.receiver)
        if not involved or (flight.doomed and link.instance == flight.instance):
            self._order(link.role, link.instance, Abort(request_id=rid))
        elif flight.doomed:
            flight.abort_receiver = True

    # ------------------------------------------------------------------ orders

    def _push(self, flight: Flight, *, after_stall: bool = False) -> None:
        receiver, sender = self._links[flight.receiver], self._links[flight.instance]
        flight.push_due = time.monotonic() + write_limit_s(sender.write_timeout_s, flight.nbytes) + PUSH_REPORT_GRACE_S
        self._pushing[flight.request_id] = flight  # (in place of a retry's earlier push)
        # Two workers of one kernel: the sender may copy into the receiver's shared pool.
        same_host = receiver.local is not None and sender.local is not None and receiver.local.host == sender.local.host
        self._order(flight.role, flight.instance, Push(request_id=flight.request_id, session=receiver.session,
                                                       address=flight.address, nbytes=flight.nbytes,
                                                       local=receiver.local if same_host else None,
                                                       after_stall=after_stall))

    def _order(self, role: Role, instance: str | None, order: WorkOrder) -> None:
        assert instance is not None
        self._pools[role].post(Send(instance=instance, order=order))
