"""TransferNegotiator: the link to every worker, and through it every hand-off.

It owns the worker ROUTER: registration, heartbeats, liveness, and everything workers
report. Reports about requests go to its ``Handoffs`` (actors/handoffs.py): the flights,
the receive slots, the fast and slow paths.

The tensors never come here: workers write into each other's memory with Mooncake and
only sizes, addresses and manifests cross this actor. The decoder's output frames pass
through untouched on their way to the frontend; they arrive on a connection of their own,
whose routing id is the decoder's key, so its heartbeats never wait behind them.

A worker whose ``Probe`` has not yet come back, one silent for two heartbeats, or a
receiver a push just failed to reach, is a suspect: it gets no new work until it is
reached or speaks again. A receiver a push failed to reach is evicted unless heard from
within two heartbeats of the failure, so a dead receiver costs one request instead of every
request dispatched to it until its heartbeats are missed. Any message counts, even from one
that is stopping or pushing late: it stays a suspect, but is not evicted. A sender whose
push is unreported past its due time is a suspect until it reports one: work sent there
would wait behind that write.

A worker is identified by its ROUTER connection, which only a registration carrying the
shared token creates; a report about a request counts only if it comes from the instance
the request's flight names. Anything else is a late or forged message and changes nothing.
"""

from __future__ import annotations

import itertools
import secrets
import time
from typing import assert_never

import anyio
import msgspec
import structlog
import zmq
import zmq.asyncio

from actors.base import reply_once, serve_mailbox
from actors.handoffs import Handoffs
from actors.links import Link, model_problem, registration_problem, work_address_problem
from actors.mail import (
    AdmissionMail,
    Farewell,
    Forget,
    FrontendMail,
    Join,
    Leave,
    LimitsChanged,
    NegotiatorMail,
    Placed,
    PoolMail,
    QueryStats,
    Stuck,
    Suspect,
    Tick,
    TrackerMail,
)
from actors.mailbox import Mailbox, MailboxCounts
from actors.recent import RecentIds
from orchestrator.config import DaemonConfig
from orchestrator.log import Throttled
from transfer.binding import FLUSH_ON_CLOSE_MS, bound_router
from transfer.protocol import (
    DAEMON_STOPPING,
    DECODE_ERRORS,
    MAX_TENSORS,
    PROTOCOL_VERSION,
    WORKER_MESSAGE,
    Allocated,
    AllocRejected,
    Done,
    Heartbeat,
    Leaving,
    Probed,
    Pushed,
    Register,
    Registered,
    RegisterRefused,
    Role,
    Staged,
    StageLimits,
    Step,
    Stopped,
    Stopping,
    WorkerMessage,
    brief,
    encode,
    other_version,
)
from transfer.reports import REPORTS_PER_MESSAGE
from transfer.sockets import NOBLOCK, PlainPump

# The frames of a worker-socket message read, its routing id included: twice the most a
# worker sends (REPORTS_PER_MESSAGE reports, or a Done and MAX_TENSORS frames), so that one
# sending too many is logged with their number. Any more are dropped unread, a batch at a
# time: anyone can connect to the socket, and its size limit is per frame, so one message of
# a million empty frames, read whole, held the daemon's loop for seconds.
WORKER_FRAMES_READ = 2 * max(1 + REPORTS_PER_MESSAGE, 2 + MAX_TENSORS)

log = structlog.get_logger()

# Silence for this many heartbeat periods makes a worker a suspect, and evicts a receiver a
# push failed to reach (instead of heartbeat_misses). Two: a live worker heartbeats every
# period, busy or not, and one late beat suspects nobody.
SUSPECT_HEARTBEATS = 2

# How long, and how many, evicted connections are remembered as settled. Past either, one
# that speaks again is told to wait out push_quarantine_s, as after a daemon restart: slower,
# never unsafe.
SETTLED_EVICTION_MEMORY_S = 3600.0
SETTLED_EVICTIONS_KEPT = 4096


class PreallocCounts(msgspec.Struct, frozen=True):
    free: int
    total: int


class NegotiatorStats(msgspec.Struct, frozen=True):
    prealloc: dict[str, PreallocCounts]
    limits: dict[str, StageLimits]
    handoffs_in_flight: int
    handoffs_held: int
    fast_path: dict[str, int]
    slow_path: dict[str, int]
    late_reports: int
    mailbox: MailboxCounts


class TransferNegotiator:
    """Owns the worker socket and the registered workers; its ``Handoffs`` owns every flight."""

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
        self._frontend = frontend
        self._sock: zmq.Socket | None = None
        self._pump: PlainPump | None = None
        self._links: dict[bytes, Link] = {}
        self._by_instance: dict[str, Link] = {}
        self._by_key: dict[bytes, Link] = {}  # a decoder's output connection's routing id is its key
        self._handoffs = Handoffs(links=self._by_instance, push_quarantine_s=cfg.push_quarantine_s, pools=pools,
                                  admission=admission, tracker=tracker, push_failed_into=self._push_failed_into)
        self._ids = itertools.count(1)
        # Main connections of workers evicted while no write was ordered into their memory:
        # none can land there later (the daemon orders none into an evicted worker), so one
        # that speaks again (it froze, say) may rejoin at once, without push_quarantine_s.
        self._settled_evictions = RecentIds(window_s=SETTLED_EVICTION_MEMORY_S, most=SETTLED_EVICTIONS_KEPT)
        self._stopping = False  # farewells sent: registrations get no answer
        self._log = log.bind(actor="negotiator")
        self._peer_log = Throttled(self._log)  # what any peer of the worker socket can make it say

    async def run(self, *, task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        with bound_router(self._ctx, self._cfg.worker_endpoint, send_hwm=self._cfg.worker_send_hwm,
                          max_message_bytes=self._cfg.worker_max_message_bytes, close_linger_ms=FLUSH_ON_CLOSE_MS,
                          plain=True) as (sock, bound):
            self._sock = sock
            self._pump = PlainPump(sock, self._on_frames, copy=False, hold=self._inbox.board.hold,
                                   most_frames=WORKER_FRAMES_READ)
            await serve_mailbox(self._inbox, self._handle, pump=self._pump.run, task_status=task_status,
                                started=bound)

    # ------------------------------------------------------------------ worker socket

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        """``[routing_id, report, report, ...]``, or ``[routing_id, Done, *its frames]`` (protocol.md §3.2)."""
        if len(frames) < 2:
            return  # a routing frame with no body
        routing_id = frames[0].bytes
        if (outputs_of := self._by_key.get(routing_id)) is not None:
            self._on_output(outputs_of, routing_id, frames)
            return
        link = self._links.get(routing_id)
        if link is None and len(frames) == 3 and len(frames[1]) == 0:
            self._answer_a_req_peer(routing_id)
            return
        first = self._decode(frames[1], answer=None if link is not None or self._stopping else routing_id, sender=link)
        if first is None:
            return
        if link is None:
            if self._stopping:
                return  # a worker rejoining the daemon that just said farewell: it retries, and its successor answers
            if isinstance(first, Register):
                self._register(routing_id, first)
            else:
                self._reply(routing_id, RegisterRefused(
                    message="not registered (the daemon restarted or evicted this worker)", rejoin=True,
                    settled=self._settled_evictions.holds(routing_id, time.monotonic())))
            return
        self._heard_from(link)
        if isinstance(first, Register):
            return  # a retried Register on a live connection: the first answer stands
        if isinstance(first, Done) and first.outputs:
            self._on_report(link, first, frames[2:])
            return
        if len(frames) > 1 + REPORTS_PER_MESSAGE:
            self._peer_log.warning("worker.too_many_reports", instance=link.instance, reports=len(frames) - 1,
                                   read=REPORTS_PER_MESSAGE)
        self._on_report(link, first, [])
        for frame in frames[2 : 1 + REPORTS_PER_MESSAGE]:
            if self._links.get(routing_id) is not link:
                return  # evicted by a report of this message (Leaving): the rest is about nothing
            msg = self._decode(frame, sender=link)
            if msg is not None:
                self._on_report(link, msg, [])

    def _heard_from(self, link: Link) -> None:
        link.last_seen = time.monotonic()
        link.push_failed_at = None  # alive: a failed push into it was not its death, even if it stays suspect
        if link.suspect and link.reached and not link.pushing_late:
            self._trust(link)  # it is alive: no longer quiet, and a failed push was not its death

    def _on_output(self, link: Link, key: bytes, frames: list[zmq.Frame]) -> None:
        """``[key, Done, *its frames]`` or ``[key, Leaving]`` from ``link``'s output
        connection, whose routing id is its key: its outputs travel there, so its
        heartbeats, on the main connection, never wait behind one crossing a slow link, and
        its last words after them, so they never overtake one. Leaving is answered there:
        the stopping decoder waits for that answer, which says every output before it
        arrived."""
        msg = self._decode(frames[1], sender=link)
        if msg is None:
            return
        if not (isinstance(msg, Leaving) or (isinstance(msg, Done) and msg.outputs)):
            self._drop_garbled(link, f"a {type(msg).__name__} on its output connection, which carries outputs "
                                     "and Leaving only")
            return
        self._heard_from(link)
        self._on_report(link, msg, frames[2:])
        if isinstance(msg, Leaving):
            self._reply(key, RegisterRefused(message=f"{link.instance} left"))

    def _decode(self, frame: zmq.Frame, *, answer: bytes | None = None,
                sender: Link | None = None) -> WorkerMessage | None:
        """The message in ``frame``, or None if it is unreadable. An unregistered peer
        (``answer``: its routing id) is told why, as its registration is what failed: a
        worker whose config the wire refuses (a field out of bounds) must not wait out its
        connect_timeout_s believing no daemon is there. A registered ``sender`` is dropped."""
        try:
            return WORKER_MESSAGE.decode(frame.buffer)
        except DECODE_ERRORS as exc:
            self._peer_log.warning("worker.bad_message", error=str(exc), registered=answer is None)
            if answer is not None:
                version = other_version(frame.buffer)
                self._reply(answer, RegisterRefused(message=f"unreadable registration: {exc}" if version is None
                                                    else f"protocol {version}, daemon speaks {PROTOCOL_VERSION}"))
            elif sender is not None:
                self._drop_garbled(sender, str(exc))
            return None

    def _drop_garbled(self, link: Link, error: str) -> None:
        """``link`` sent a report the wire refuses (a field out of bounds, say). What it said
        is unknown (a stage's end, a push's?), so the requests it holds would each wait out
        their deadlines. A worker that speaks so is broken (an honest one checks its outputs
        against the wire's bounds before it reports): it is evicted as a lost one is, its
        requests retried elsewhere and the memory a write of its may still reach held back,
        and told why, which ends it (a restart of the same build would only do it again)."""
        why = brief(f"{link.instance} sent a report the daemon cannot read: {error}")
        self._evict(link, why, gone=False)
        self._reply(link.routing_id, RegisterRefused(message=why))

    def _answer_a_req_peer(self, routing_id: bytes) -> None:
        """``[routing_id, b"", body]`` is a REQ socket's envelope (workers speak DEALER, with no
        empty frame): a client or control command at the wrong endpoint. Answered in that
        envelope, or its REQ socket drops the answer and waits out its deadline."""
        self._peer_log.warning("worker.not_a_worker", why="a REQ socket's message on the worker socket")
        self._reply(routing_id, RegisterRefused(
            message="this is the daemon's worker socket; clients and control commands have endpoints of their own "
                    "(daemon.client_endpoint, daemon.control_endpoint)"), envelope=[b""])

    def _reply(self, routing_id: bytes, msg: Registered | RegisterRefused, *,
               envelope: list[bytes] | None = None) -> None:
        assert self._sock is not None and self._pump is not None
        # A ROUTER drops a reply to a peer that is gone or not reading; it never blocks.
        self._sock.send_multipart([routing_id, *(envelope or []), encode(msg)], flags=NOBLOCK)
        # Replies also leave from a Tick or the farewell, outside the socket's reader.
        self._pump.after_send()

    def _register(self, routing_id: bytes, msg: Register) -> None:
        live = [link for link in self._links.values() if not self._silent(link)]
        problem = (registration_problem(msg, self._cfg.token, self._cfg.push_quarantine_s) or model_problem(msg, live)
                   or work_address_problem(self._ctx, msg.work_address))
        refusal = RegisterRefused(message=problem) if problem is not None else (
            self._claimed_by_another(msg) or self._full(msg) or self._model_of_the_silent(msg))
        if refusal is not None:
            self._peer_log.warning("worker.refused", name=msg.name, why=refusal.message)
            self._reply(routing_id, refusal)
            return
        for stale in [old for old in self._links.values() if old.same_worker_as(msg)]:
            # Same name, session or shared pool, new connection: a restart. The old process is
            # dead, or silent for two heartbeats (frozen), or it is this one (the same session:
            # one process binds it). One silent for a while is taken for the dead one of a
            # restart, and what it was pushing into is freed at once; one heard from lately
            # may still be pushing, so its writes get their Pushed or the quarantine. The old
            # connection is told to stop, so a frozen one that wakes does not rejoin and evict
            # its successor. (A dead one's connection is gone: the ROUTER drops it.)
            silent = self._silent(stale)
            self._evict(stale, f"{stale.instance} re-registered as a new process", gone=silent)
            self._reply(stale.routing_id, RegisterRefused(message=self._replaced_by(msg, stale)))
        instance = f"{msg.role}-{next(self._ids)}"
        now = time.monotonic()
        key = secrets.token_bytes(16)
        link = Link(routing_id, instance, msg.role, msg.name, msg.session, msg.pool_base, msg.pool_size,
                    msg.work_address, joined_at=now, last_seen=now, key=key, local=msg.local, limits=msg.limits,
                    model_digest=msg.model_digest, write_timeout_s=msg.write_timeout_s)
        self._links[routing_id] = link
        self._by_instance[instance] = link
        self._by_key[key] = link
        fits = self._handoffs.add_receiver(link, msg.slots) if msg.role != "encoder" else 0
        self._pools[msg.role].post(Join(instance=instance, name=msg.name, work_address=msg.work_address,
                                         session=msg.session, key=key, capacity=msg.capacity, fits=fits,
                                         limits=msg.limits))
        self._frontend.post(LimitsChanged(role=msg.role, instance=instance, limits=msg.limits))
        self._reply(routing_id, Registered(instance=instance, key=key, heartbeat_s=self._cfg.heartbeat_s,
                                           push_quarantine_s=self._cfg.push_quarantine_s,
                                           max_message_bytes=self._cfg.worker_max_message_bytes))
        self._log.info("worker.registered", instance=instance, name=msg.name, role=msg.role,
                       session=msg.session, slots=[s.size for s in msg.slots], capacity=msg.capacity,
                       limits=msgspec.to_builtins(msg.limits))

    @staticmethod
    def _replaced_by(msg: Register, stale: Link) -> str:
        """What ``stale``'s connection is told when ``msg`` takes its place."""
        if msg.name == stale.name:
            return f"another worker registered under the name {msg.name!r}: worker names must be unique"
        if msg.session == stale.session or msg.local is None:
            return f"another worker registered the Mooncake session {msg.session}"
        return f"another worker registered the shared memory {msg.local.path}"

    def _claimed_by_another(self, msg: Register) -> RegisterRefused | None:
        """A worker heard from lately holds ``msg``'s Mooncake session under another name, or
        its name as another process (another role, or another session and memory): the
        newcomer is refused and the live one serves on. Two links on one session would have
        pushes meant for one pool land in the other's memory; two live processes under one
        name (a copied unit file) would evict each other, failing what the evicted one held.
        The refusal says rejoin: a restarted worker whose predecessor still counts as live
        gets in once that one falls silent (then taken for dead, and replaced); one that
        never does gives up after its connect_timeout_s, naming why."""
        for old in self._links.values():
            if self._silent(old):
                continue
            if old.session == msg.session and old.name != msg.name:
                return RegisterRefused(rejoin=True, deferred=True, message=(
                    f"the Mooncake session {msg.session} is registered by {old.instance} ({old.name!r}), "
                    "which is still heard from: a session names one worker's memory"))
            if old.shares_memory(msg) and old.name != msg.name and msg.local is not None:
                # The same for a same-host copy, which lands in the file the receiver advertised.
                return RegisterRefused(rejoin=True, deferred=True, message=(
                    f"the shared memory {msg.local.path} is registered by {old.instance} ({old.name!r}), "
                    "which is still heard from: it is one worker's pool"))
            if old.name == msg.name and (old.role != msg.role or not old.same_memory_as(msg)):
                return RegisterRefused(rejoin=True, deferred=True, message=(
                    f"the name {msg.name!r} is held by {old.instance}, a live {old.role} worker: "
                    "worker names must be unique"))
        return None

    def _model_of_the_silent(self, msg: Register) -> RegisterRefused | None:
        """Only silent workers (killed, say, with no Leaving) serve another model: they are
        evicted soon, and the newcomer, refused for now, gets in then instead of exiting."""
        problem = model_problem(msg, self._links.values())
        return None if problem is None else RegisterRefused(rejoin=True, deferred=True, message=problem)

    def _full(self, msg: Register) -> RegisterRefused | None:
        """Refuse a newcomer past ``max_workers`` (one replacing its own stale link is no
        newcomer). It retries: it gets in once another leaves."""
        replacing = any(old.same_worker_as(msg) for old in self._links.values())
        if replacing or len(self._links) < self._cfg.max_workers:
            return None
        return RegisterRefused(rejoin=True, deferred=True, message=(
            f"the daemon serves at most {self._cfg.max_workers} workers at once (daemon.max_workers), and has "
            "that many"))

    def _silent(self, link: Link) -> bool:
        return time.monotonic() - link.last_seen > SUSPECT_HEARTBEATS * self._cfg.heartbeat_s

    # ------------------------------------------------------------------ reports

    def _on_report(self, link: Link, msg: WorkerMessage, frames: list[zmq.Frame]) -> None:
        match msg:
            case Heartbeat():
                pass
            case Probed(instance=instance):
                if instance == link.instance and not link.reached:
                    link.reached = True
                    self._trust(link)  # the pool offers it work from now on
            case Stopping():
                link.stopping = True
                self._suspect(link)
                self._log.info("worker.stopping", instance=link.instance)
            case Leaving():
                # Sent after its threads ended: no write of its is in flight (gone=True).
                self._evict(link, f"{link.instance} left: its process is stopping")
            case Staged():
                self._handoffs.staged(link, msg)
            case Allocated():
                self._handoffs.allocated(link, msg)
            case AllocRejected():
                self._handoffs.alloc_rejected(link, msg)
            case Pushed():
                self._handoffs.pushed(link, msg)
                if link.pushing_late:  # its push path moves again
                    link.pushing_late = False
                    self._trust(link)
            case Done():
                self._handoffs.done(link, msg, frames)
            case Step():
                self._handoffs.step(link, msg)
            case Stopped():
                self._handoffs.stopped(link, msg)
            case Register():
                pass  # only a message's first report registers
            case _:
                assert_never(msg)

    # ------------------------------------------------------------------ mail

    def _handle(self, mail: NegotiatorMail) -> None:
        match mail:
            case Placed(job=job, instance=instance):
                self._handoffs.placed(job, instance)
            case Forget(request_id=rid):
                self._handoffs.forget(rid)
            case Tick(gap_s=gap_s):
                self._check_liveness(time.monotonic(), stalled_s=gap_s)
            case Farewell():
                self._farewell()
            case Stuck(instance=instance, message=message):
                link = self._by_instance.get(instance)
                if link is not None:  # later flushes to it say so again until its Leave lands
                    self._evict(link, message, gone=False)
            case QueryStats(reply=reply):
                h = self._handoffs
                prealloc = {instance: PreallocCounts(*h.prealloc_counts(instance)) for instance in self._by_instance}
                limits = {instance: link.limits for instance, link in self._by_instance.items()}
                reply_once(reply, NegotiatorStats(prealloc, limits, h.in_flight(), h.held(), dict(h.fast),
                                                  dict(h.slow), h.late, self._inbox.counts()))
            case _:
                assert_never(mail)

    def _farewell(self) -> None:
        """Tell every worker the daemon stops, to rejoin its successor; ``settled`` for each
        that no flight still names as receiver, so no write ordered here can land in its
        memory later and it need not wait out push_quarantine_s when it rejoins."""
        receiving = self._handoffs.receivers()
        for link in self._links.values():
            self._reply(link.routing_id, RegisterRefused(message=DAEMON_STOPPING, rejoin=True,
                                                         settled=link.instance not in receiving))
        self._stopping = True
        self._log.info("negotiator.farewell", workers=len(self._links), unsettled=len(receiving))

    # ------------------------------------------------------------------ liveness

    def _suspect(self, link: Link) -> None:
        """No new work for ``link`` until it is heard from."""
        if not link.suspect:
            link.suspect = True
            self._pools[link.role].post(Suspect(instance=link.instance, suspect=True))

    def _push_failed_into(self, link: Link) -> None:
        """A write into ``link`` failed: it gets no new work, and is evicted unless heard from
        within two heartbeats (a dead receiver then costs one request, not every one sent
        its way until its heartbeats are missed)."""
        if link.push_failed_at is None:
            link.push_failed_at = time.monotonic()
            self._suspect(link)

    def _trust(self, link: Link) -> None:
        if link.stopping:
            return  # alive, but it asked for no new work
        link.suspect = False
        self._pools[link.role].post(Suspect(instance=link.instance, suspect=False))

    def _check_liveness(self, now: float, *, stalled_s: float = 0.0) -> None:
        heartbeat_s = self._cfg.heartbeat_s
        limit = heartbeat_s * self._cfg.heartbeat_misses
        if stalled_s > heartbeat_s:  # the negotiator ticks every half heartbeat (daemon.py)
            self._forgive_stall(now, stalled_s)
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
        for instance in self._handoffs.late_senders(now):
            link = self._by_instance.get(instance)
            if link is not None and not link.pushing_late:
                link.pushing_late = True
                self._log.warning("worker.push_overdue", instance=instance,
                                  why="a push it was sent is unreported past its due time: no new work until it is")
                self._suspect(link)
        self._handoffs.expire_quarantine(now)

    def _forgive_stall(self, now: float, stalled_s: float) -> None:
        """The daemon stood still for up to ``stalled_s`` (stopped, a frozen VM, a long
        collection; it may have begun any time after the last tick, so all of it is
        forgiven): the heartbeats of that time wait unread in its socket, so it is no
        worker's silence.
        Without this, every worker would be evicted on waking, and a denoiser or decoder would
        then sit out ``push_quarantine_s`` before it could rejoin."""
        for link in self._links.values():
            link.last_seen = min(now, link.last_seen + stalled_s)
            link.joined_at = min(now, link.joined_at + stalled_s)
            if link.push_failed_at is not None:
                link.push_failed_at = min(now, link.push_failed_at + stalled_s)
        self._handoffs.postpone_pushes(stalled_s)
        self._log.warning("daemon.stalled", stalled_s=round(stalled_s, 3),
                          why="no worker's silence in that time counts against it")

    def _refuse_unreached(self, link: Link, limit_s: float) -> None:
        """Drop a worker whose work socket the daemon cannot reach, and tell it why: it was
        never offered work, and registering again would change nothing."""
        why = (f"the daemon's orders to work_address {link.work_address} did not arrive within {limit_s:.1f}s: "
               f"the worker's advertise_host, its bind_host or work_socket, or a firewall, does not let the "
               f"daemon reach it")
        self._evict(link, f"{link.instance}: {why}")
        self._reply(link.routing_id, RegisterRefused(message=why))

    def _evict(self, link: Link, why: str, *, gone: bool = True) -> None:
        """Forget a worker. ``gone``: no write of its can still land (it said Leaving after
        its threads ended, it never got work, or a new process registered its name or
        session after it fell silent, so it is taken for dead); otherwise it may yet finish one."""
        if link.instance not in self._handoffs.receivers():
            self._settled_evictions.add(link.routing_id, time.monotonic())
        del self._links[link.routing_id]
        del self._by_instance[link.instance]
        del self._by_key[link.key]
        self._pools[link.role].post(Leave(instance=link.instance, message=why))
        self._frontend.post(LimitsChanged(role=link.role, instance=link.instance, limits=None))
        self._handoffs.worker_lost(link, why, gone=gone)
        self._log.warning("worker.evicted", instance=link.instance, why=why)
