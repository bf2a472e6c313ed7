"""FrontendActor: sole owner of the client ROUTER.

It turns bytes into typed requests and typed replies into bytes, and nothing else reaches
the socket. Bad input of any kind gets a ``Rejected`` naming the problem and the loop goes
on. The decoder's output frames are relayed exactly as they arrived from the worker
(``copy=False``): never decoded, re-encoded or copied here.

It also remembers who asked for each in-flight request, which makes it the natural place to
refuse duplicates, to shed load past ``max_in_flight`` and to refuse work while draining,
and to cancel what a client asked for once its connection is gone: the socket's monitor
says when a connection closes (client_connections.py), and a reply that finds no way to
its client (EHOSTUNREACH) says so too.
"""

from __future__ import annotations

import hmac
import itertools
import time
import uuid
from dataclasses import dataclass
from typing import assert_never

import anyio
import msgspec
import structlog
import zmq
import zmq.asyncio

from actors.base import reply_once, serve_mailbox
from actors.client_connections import ClientConnections
from actors.client_outbox import ClientOutbox
from actors.door import DoorLimits
from actors.mail import (
    BY_THE_CLIENT,
    CLIENT_GONE,
    RETRIED,
    Admit,
    CancelRequest,
    Deliver,
    FrontendMail,
    LimitsChanged,
    QueryStats,
    SetDraining,
    TrackerMail,
)
from actors.mailbox import Mailbox, MailboxCounts
from actors.recent import RecentIds
from orchestrator.config import DaemonConfig
from orchestrator.limits import raw_output_violation
from orchestrator.log import Throttled
from transfer.binding import FLUSH_ON_CLOSE_MS, bound_router
from transfer.protocol import (
    CLIENT_REQUEST,
    DECODE_ERRORS,
    PROTOCOL_VERSION,
    Cancel,
    Cancelled,
    ClientReply,
    GenParams,
    Progress,
    Reason,
    Rejected,
    Role,
    Submit,
    encode,
    other_version,
    stated_request_id,
    wrong_socket,
)
from transfer.sockets import EVENTS, POLLIN, SRCFD, PlainPump, recv_head

log = structlog.get_logger()

# Requests a stopping daemon still reads off its client socket to answer them (draining).
UNREAD_ANSWERED = 1024
# The frames of a client message read, its identity included (a valid one has 3); any
# more are dropped unread, a batch at a time, so that no client's message of millions of
# empty frames holds the daemon's loop (transfer/sockets.py, PlainPump).
CLIENT_FRAMES_READ = 8
# A Cancel that finds nothing may have overtaken its Submit: a blocking client interrupted
# just after sending cancels on a fresh connection, and the ROUTER reads connections in no
# set order. That id's Submit arriving within this is refused as cancelled, not run for
# nobody; unless the id's request had just ended (then the Cancel came late, not early).
CANCEL_OVERTAKES_S = 1.0
FORESEEN_CANCELS = 4096  # ids remembered so, at the most (the oldest forgotten first); as many ended ones


class FrontendStats(msgspec.Struct, frozen=True):
    in_flight: int
    draining: bool
    retried: int
    replies_dropped: int
    refused: dict[str, int]
    mailbox: MailboxCounts


@dataclass(slots=True)
class Asked:
    """Who asked for an admitted request, and what it takes to start it again."""

    identity: bytes
    request_id: str  # the client's id
    params: GenParams
    priority: int
    progress: bool
    submitted_at: float  # monotonic
    deadline: float  # monotonic: a retry gets what is left of it, never more
    retries_left: int
    cancel_token: str  # Submit.cancel_token: what a Cancel must carry to stop it ("": nothing)
    avoid: frozenset[str] = frozenset()  # instances its failed attempts involved (Job.avoid)
    cancelled: str = ""  # why, once cancelled: a failure that crossed the cancel ends it so


class FrontendActor:
    """Owns the client socket and the map from request id to the client that asked."""

    def __init__(
        self,
        inbox: Mailbox[FrontendMail],
        *,
        ctx: zmq.asyncio.Context,
        cfg: DaemonConfig,
        tracker: Mailbox[TrackerMail],
    ) -> None:
        self._inbox = inbox
        self._ctx = ctx
        self._cfg = cfg
        self._tracker = tracker
        self._pump: PlainPump | None = None
        self._connections: ClientConnections | None = None
        self._outbox: ClientOutbox | None = None
        self._newly_held = anyio.Event()  # set when a connection starts holding replies
        # Each admission gets its own internal key, never reused, so news about an ended
        # request can never be mistaken for a later one that reuses the client's id.
        self._keys = itertools.count()
        self._clients: dict[str, Asked] = {}  # internal key -> who asked
        self._in_flight: dict[str, str] = {}  # client's id -> internal key
        # (id, cancel token) of Cancels that came before their Submit: only a Submit carrying
        # that token is refused for it, so nobody can keep another client's id from running.
        self._foreseen = RecentIds(CANCEL_OVERTAKES_S, FORESEEN_CANCELS)
        self._just_ended = RecentIds(CANCEL_OVERTAKES_S, FORESEEN_CANCELS)  # ids whose request just ended
        self._of_connection: dict[bytes, set[str]] = {}  # client connection -> its internal keys
        self._door = DoorLimits()
        self._started = time.monotonic()
        self._draining = False
        self._retried = 0
        self._refused: dict[str, int] = {}  # by reason: submits refused at the door
        self._unsent: list[tuple[list, bool]] = []  # replies waiting for the flush, and whether awaited
        self._log = log.bind(actor="frontend")
        # Refusals come in floods (a client past max_in_flight, a buggy one): a few lines each
        # window, the rest counted on the next.
        self._refusals_log = Throttled(self._log)

    async def run(self, *, task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        # Replies already handed to ZMQ get a bounded moment to leave on shutdown.
        with bound_router(self._ctx, self._cfg.client_endpoint, send_hwm=self._cfg.client_send_hwm,
                          max_message_bytes=self._cfg.client_max_message_bytes,
                          close_linger_ms=FLUSH_ON_CLOSE_MS, plain=True, mandatory=True) as (sock, bound), \
                ClientConnections(self._ctx, sock, self._connection_gone) as self._connections:
            self._pump = PlainPump(sock, self._on_frames, copy=False, hold=self._inbox.board.hold,
                                   most_frames=CLIENT_FRAMES_READ)
            self._outbox = ClientOutbox(sock, held_bytes=self._cfg.client_held_bytes,
                                        held_total_bytes=self._cfg.client_held_total_bytes,
                                        on_gone=self._connection_gone, log=self._log)
            try:
                await serve_mailbox(self._inbox, self._handle, pump=self._serve_socket, task_status=task_status,
                                    started=bound)
            finally:
                self._answer_unread(sock)
                # The last answers of a drain, to clients that read: a bounded moment more.
                with anyio.CancelScope(shield=True), anyio.move_on_after(FLUSH_ON_CLOSE_MS / 1000):
                    await self._resend_held(until_empty=True)
                self._outbox.abandon()

    def _answer_unread(self, sock: zmq.Socket) -> None:
        """As the daemon stops: what reached the socket after its last read gets an answer
        (``draining``, for a submit) instead of silence until the client's deadline. A
        bounded read; what arrives after it meets a closed socket."""
        self._draining = True
        assert self._pump is not None
        if self._pump.mid_message:
            return  # dropping an overlong message's rest, which the close does at once
        with self._inbox.board.hold():  # its end flushes the replies (``_send``)
            for _ in range(UNREAD_ANSWERED):
                if not sock.getsockopt(EVENTS) & POLLIN:
                    return
                frames, more = recv_head(sock, copy=False, most=CLIENT_FRAMES_READ)
                if more:
                    return  # an overlong message: not read on, as the daemon stops
                self._on_frames(frames)

    async def _serve_socket(self) -> None:
        assert self._pump is not None
        assert self._connections is not None
        closes = PlainPump(self._connections.monitor, self._connections.heard, copy=True,
                           hold=self._inbox.board.hold)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._pump.run)
            tg.start_soon(closes.run)
            tg.start_soon(self._resend_held)

    async def _resend_held(self, *, until_empty: bool = False) -> None:
        """Send held replies as each connection's turn comes; sleep until the next is due,
        or a connection starts holding (``_flush``), or for good while nothing is held."""
        assert self._outbox is not None and self._pump is not None
        while True:
            with self._inbox.board.hold():  # what a gone connection cancels waits for the resends
                due = self._outbox.resend(time.monotonic())
            self._pump.after_send()
            if due is None and until_empty:
                return
            with anyio.move_on_after(None if due is None else due - time.monotonic()):
                await self._newly_held.wait()
            self._newly_held = anyio.Event()

    # ------------------------------------------------------------------ inbound

    def _on_frames(self, parts: list[zmq.Frame]) -> None:
        frames = [part.bytes for part in parts]
        identity = frames[0]
        # REQ and DEALER clients both put an empty delimiter before the body.
        if len(frames) != 3 or frames[1] != b"":
            got = f"{len(frames) - 1}" if len(frames) < CLIENT_FRAMES_READ else f"{CLIENT_FRAMES_READ - 1} or more"
            self._refuse(identity, "", Reason.INVALID, wrong_socket("client", frames[-1])
                         or f"invalid request: expected [empty, body] frames, got {got}")
            return
        try:
            msg = CLIENT_REQUEST.decode(frames[2])
        except DECODE_ERRORS as exc:
            # Another version's request may not decode here (a GenParams field added since):
            # its sender hears of the version, under its request's id.
            if (version := other_version(frames[2])) is not None:
                self._refuse_version(identity, stated_request_id(frames[2]), version)
            else:
                self._refuse(identity, "", Reason.INVALID,
                             wrong_socket("client", frames[2]) or f"invalid request: {exc}")
            return
        if msg.protocol != PROTOCOL_VERSION:
            self._refuse_version(identity, msg.request_id, msg.protocol)
            return
        match msg:
            case Submit():
                self._submit(identity, msg, parts[0])
            case Cancel(request_id=rid, cancel_token=token):
                key = self._in_flight.get(rid)
                # A Cancel's answer is no request's end, and its client may not wait for it (a
                # closing AsyncClient sends its Cancels and leaves): one that finds the client
                # gone is not counted lost.
                if key is not None and not self._may_cancel(self._clients[key], token):
                    # A client whose own Cancel of an id crossed its end and another client's
                    # Submit of the id gets this too.
                    self._send(identity, Cancelled(request_id=rid, found=False, refused=True), awaited=False)
                    return
                if key is not None:
                    self._cancel(key, BY_THE_CLIENT)
                elif not self._just_ended.holds(rid, now := time.monotonic()):
                    self._foreseen.add((rid, token), now)
                self._send(identity, Cancelled(request_id=rid, found=key is not None), awaited=False)
            case _:
                assert_never(msg)

    @staticmethod
    def _may_cancel(asked: Asked, token: str) -> bool:
        """Whether a Cancel carrying ``token`` may stop ``asked``: any may, if it was submitted
        without a token."""
        return not asked.cancel_token or hmac.compare_digest(token.encode(), asked.cancel_token.encode())

    def _submit(self, identity: bytes, msg: Submit, head: zmq.Frame) -> None:
        rid = msg.request_id or uuid.uuid4().hex
        problem: tuple[Reason, str] | None = None
        if self._foreseen.take((rid, msg.cancel_token), time.monotonic()):
            problem = Reason.CANCELLED, f"{BY_THE_CLIENT}: its Cancel came first, by another connection"
        elif self._draining:
            problem = Reason.DRAINING, "the daemon is draining and takes no new work"
        elif rid in self._in_flight:
            problem = Reason.DUPLICATE, f"request {rid!r} is already in flight"
        elif len(self._clients) >= self._cfg.max_in_flight:
            problem = Reason.OVERLOADED, f"{len(self._clients)} requests in flight (max_in_flight)"
        elif violation := (self._door.violation(msg.params)
                           or raw_output_violation(msg.params, self._cfg.worker_max_message_bytes)):
            problem = Reason.INVALID, violation
        elif not self._watch(identity, head):  # last: what passes it is admitted
            problem = Reason.CANCELLED, f"{CLIENT_GONE} before its request was read"
        if problem is not None:
            self._refuse(identity, rid, *problem, awaited=problem[0] != Reason.CANCELLED)
            # Ended here: a Cancel of it that finds nothing now came late, not before its Submit.
            self._just_ended.add(rid, time.monotonic())
            return
        timeout_s = min(msg.timeout_s or self._cfg.request_timeout_s, self._cfg.max_request_timeout_s)
        now = time.monotonic()
        self._admit(Asked(identity, rid, msg.params, msg.priority, msg.progress, now, now + timeout_s,
                          self._cfg.retries, msg.cancel_token), timeout_s)

    def _watch(self, identity: bytes, head: zmq.Frame) -> bool:
        """File the connection a Submit came by (``head``, its first frame, names the
        descriptor), so that its close cancels what it waits for; False if it closed already."""
        assert self._connections is not None
        return self._connections.watch(identity, head.get(SRCFD))

    def _refuse(self, identity: bytes, rid: str, reason: Reason, message: str, *, awaited: bool = True) -> None:
        """Refuse a request at the door (never admitted): count it by reason, and log it."""
        self._refused[reason] = self._refused.get(reason, 0) + 1
        self._refusals_log.warning("request.refused", request_id=rid, reason=str(reason), message=message)
        self._send(identity, Rejected(request_id=rid, reason=reason, message=message), awaited=awaited)

    def _refuse_version(self, identity: bytes, rid: str, version: int | None) -> None:
        self._refuse(identity, rid, Reason.UNSUPPORTED, f"protocol {version}; this daemon speaks {PROTOCOL_VERSION}")

    def _admit(self, asked: Asked, timeout_s: float, *, again: bool = False) -> None:
        key = f"{asked.request_id}#{next(self._keys)}"
        self._clients[key] = asked
        self._in_flight[asked.request_id] = key
        self._of_connection.setdefault(asked.identity, set()).add(key)
        self._tracker.post(Admit(request_id=key, params=asked.params, timeout_s=timeout_s, priority=asked.priority,
                                 progress=asked.progress, submitted_at=asked.submitted_at, avoid=asked.avoid,
                                 again=again))

    def _retry(self, asked: Asked, failure: ClientReply, implicated: frozenset[str]) -> bool:
        """Start a request again whose worker was lost or whose hand-off failed, if it may;
        True if it did. Both say the pipeline broke under the request, not that the request
        is bad (which ``invalid`` and ``stage_failed`` say, and retrying would not mend).

        The old admission's every slot and buffer is freed by its own failure (the Forget
        chain, as for any failure), and the retry is a new admission under a new key, so
        nothing the old one left behind can touch it. Not while draining: the drain may
        already count the request as ended.
        """
        if not (isinstance(failure, Rejected) and failure.reason in RETRIED):
            return False
        left_s = asked.deadline - time.monotonic()
        if asked.retries_left == 0 or self._draining or left_s <= 0:
            return False
        asked.retries_left -= 1
        asked.avoid |= implicated
        self._retried += 1
        if asked.progress:
            self._send(asked.identity, Progress(request_id=asked.request_id, state="retrying",
                                                elapsed_ms=(time.monotonic() - asked.submitted_at) * 1000,
                                                why=failure.message))
        self._admit(asked, left_s, again=True)
        self._log.warning("request.retried", request_id=asked.request_id, why=failure.message,
                          retries_left=asked.retries_left, left_s=round(left_s, 3))
        return True

    # ------------------------------------------------------------------ outbound

    def _handle(self, mail: FrontendMail) -> None:
        match mail:
            case Deliver(request_id=key, message=Progress() as progress):
                asked = self._clients.get(key)
                # Cancelled: its client's connection is gone (nothing to send), or its client
                # cancelled it and may have left (a reply nobody waits for: not counted lost).
                if asked is not None and asked.cancelled != CLIENT_GONE:
                    self._send(asked.identity, msgspec.structs.replace(progress, request_id=asked.request_id),
                               awaited=not asked.cancelled)
            case Deliver(request_id=key, message=message, frames=frames, avoid=avoid):
                asked = self._clients.pop(key, None)
                if asked is not None:
                    del self._in_flight[asked.request_id]
                    self._just_ended.add(asked.request_id, time.monotonic())
                    if asked.cancelled and isinstance(message, Rejected) and message.reason in RETRIED:
                        message = Rejected(request_id=key, reason=Reason.CANCELLED, message=asked.cancelled)
                    retried = self._retry(asked, message, avoid)
                    self._ended(asked.identity, key)  # after the retry's admission: the connection stays watched
                    if not retried:
                        # A client that cancelled its request may have closed its connection;
                        # one whose connection closed has none: neither reply counts as dropped.
                        self._send(asked.identity, self._explained(message, asked.request_id), frames,
                                   awaited=asked.cancelled not in (BY_THE_CLIENT, CLIENT_GONE))
            case SetDraining():
                self._draining = True
            case LimitsChanged(role=role, instance=instance, limits=None):
                self._door.left(role, instance)
            case LimitsChanged(role=role, instance=instance, limits=limits):
                self._door.joined(role, instance, limits)
            case QueryStats(reply=reply):
                assert self._outbox is not None
                reply_once(reply, FrontendStats(len(self._clients), self._draining, self._retried,
                                                self._outbox.dropped, dict(self._refused), self._inbox.counts()))
            case _:
                assert_never(mail)

    def _ended(self, identity: bytes, key: str) -> None:
        keys = self._of_connection.get(identity)
        if keys is not None:  # None: its connection is gone, and the request was cancelled
            keys.discard(key)
            if not keys:
                del self._of_connection[identity]
                assert self._connections is not None
                self._connections.unwatch(identity)

    def _connection_gone(self, identity: bytes) -> None:
        """``identity``'s connection closed (its monitor said so, or a reply found no way
        there): cancel what it still waits for (each ends as any cancel does, its reply
        dropped: not counted, the daemon knows)."""
        assert self._connections is not None
        self._connections.unwatch(identity)
        # One its client cancelled already is on its way out: its reply goes nowhere either way.
        keys = [key for key in self._of_connection.pop(identity, ()) if not self._clients[key].cancelled]
        if keys:
            self._log.info("client.gone", cancelled=sorted(self._clients[key].request_id for key in keys))
        for key in keys:
            self._cancel(key, CLIENT_GONE)

    def _cancel(self, key: str, why: str) -> None:
        """End admitted request ``key``. A failure of it may be on its way here already
        (worker_lost, say): that one ends it as cancelled too, and starts nothing again."""
        self._clients[key].cancelled = why
        self._tracker.post(CancelRequest(request_id=key, why=why))

    def _explained(self, message: ClientReply, rid: str) -> ClientReply:
        """``message`` under the client's id; a timeout also says which roles no worker
        serves, the likely reason it waited (a pipeline missing a stage waits, rather than
        refuses, so that a restarting worker costs no request)."""
        if isinstance(message, Rejected) and message.reason == Reason.TIMED_OUT and (missing := self._door.unserved()):
            return msgspec.structs.replace(message, request_id=rid, message=(
                f"{message.message}; no {' or '.join(missing)} worker is registered{self._rejoin_hint(missing)}"))
        return msgspec.structs.replace(message, request_id=rid)

    def _rejoin_hint(self, missing: list[Role]) -> str:
        """Why receivers may be missing from a daemon that started less than
        push_quarantine_s ago: those of a daemon that stopped without its farewell (a crash)
        sit out the quarantine before they register (encoders, which nothing writes into,
        rejoin at once)."""
        age_s, quarantine_s = time.monotonic() - self._started, self._cfg.push_quarantine_s
        if age_s >= quarantine_s or missing == ["encoder"]:
            return ""
        return (f" (this daemon started {age_s:.0f}s ago: the denoisers and decoders of one that stopped without "
                f"its farewell, a crash, rejoin after daemon.push_quarantine_s, {quarantine_s:g}s)")

    def _send(self, identity: bytes, message: ClientReply, frames: tuple | list = (), *, awaited: bool = True) -> None:
        """Queue a reply: replies leave together once the daemon is quiet. Not ``awaited``: the
        end of a request its client cancelled, which finding no client is no reply lost."""
        if not self._unsent:
            self._inbox.board.when_quiet(self._flush)
        self._unsent.append(([identity, b"", encode(message), *frames], awaited))

    def _flush(self) -> None:
        assert self._outbox is not None and self._pump is not None
        unsent, self._unsent = self._unsent, []
        now = time.monotonic()
        for parts, awaited in unsent:
            # Never blocks: sent, held, or dropped (client_outbox.py).
            if self._outbox.send(parts, now, awaited=awaited):
                self._newly_held.set()
        self._pump.after_send()
