"""The wire: every message that crosses a process boundary, as msgspec tagged unions.

Three families share one encoding (msgpack, tag field ``kind``):

* client <-> daemon: ``Submit``/``Cancel`` in, ``Result``/``Rejected``/``Cancelled`` out, and
  ``Progress`` before the answer when the submit asked for it;
* control: ``GetStats``/``ListWorkers``/``Drain`` in, ``Stats``/``Workers``/``Draining`` (or
  ``Rejected``) out;
* worker <-> daemon: registration, heartbeats, work and the tensor hand-off.

Tensors never go through msgpack. A message that carries tensors is the encoded header
followed by one raw ZMQ frame per tensor, in the order of its ``TensorSpec`` list.

Schema evolution: new fields are appended with defaults; wire structs do not forbid
unknown fields, so an older peer skips what it does not know. ``GenParams`` alone forbids
them (a field that changes what is generated must not be skipped): adding one bumps the
version. The protocol version is
checked on the messages that open an exchange (``Submit``, ``Cancel``, ``Register``), not on
every message.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

import msgspec

PROTOCOL_VERSION = 4

Role = Literal["encoder", "denoiser", "decoder"]
ROLES: tuple[Role, ...] = ("encoder", "denoiser", "decoder")

MAX_REQUEST_ID = 128
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID)]
CancelToken = Annotated[str, msgspec.Meta(max_length=64)]
Dim = Annotated[int, msgspec.Meta(ge=1, le=16384)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
# A duration a worker reports. NaN or infinity would poison the daemon's running means
# (ETAs, latency totals) for good; the wire refuses them.
Millis = Annotated[float, msgspec.Meta(ge=0, le=1e9)]
# What a worker registers and the daemon relays in its orders to other workers (names,
# addresses, Mooncake sessions): bounded, with the tensor headers below, so that no order
# can outgrow the frame limit of a work socket (ORDER_MAX_MESSAGE_BYTES), which would drop it.
MAX_LABEL = 512
Label = Annotated[str, msgspec.Meta(max_length=MAX_LABEL)]
# A worker's account of a failure, relayed to the client: an exception's text can hold a
# whole tensor's printout.
MAX_ERROR_TEXT = 4096
ErrorText = Annotated[str, msgspec.Meta(max_length=MAX_ERROR_TEXT)]
MAX_TENSORS = 64  # per hand-off or result
MAX_SLOTS = 4096  # preallocated receive slots per worker: the daemon sorts and checks them all on its loop
MAX_TENSOR_NAME = 256
MAX_DIMS = 8
# Work orders in one daemon -> worker message (its key frame first): the pool sends more as
# several messages, and a worker reads no more frames of one, so that a stranger's message of
# millions of empty frames (each within the work socket's size limit) never holds its loop.
ORDERS_PER_MESSAGE = 256
# How a hand-off's bytes moved: the transfer engine, or a copy into shared memory (same host).
Via = Literal["mooncake", "memcpy"]


class Reason(enum.StrEnum):
    """Why a request did not produce a result. Clients switch on this, not on the text."""

    INVALID = "invalid"
    DUPLICATE = "duplicate"
    OVERLOADED = "overloaded"
    DRAINING = "draining"
    TIMED_OUT = "timed_out"
    STAGE_FAILED = "stage_failed"
    TRANSFER_FAILED = "transfer_failed"
    WORKER_LOST = "worker_lost"
    CANCELLED = "cancelled"
    UNSUPPORTED = "unsupported"


class Wire(msgspec.Struct, tag=True, tag_field="kind", frozen=True, kw_only=True):
    """Base of every wire message; the tag is the class name."""


class Plain(msgspec.Struct, frozen=True, kw_only=True):
    """A value nested inside wire messages (untagged)."""


# --------------------------------------------------------------------------- tensors


class TensorSpec(Plain):
    """One tensor of a message: where it sits in a staged block or which frame holds it.

    ``offset`` is relative to the start of the staged block (hand-offs); for frames it is 0.
    ``dtype`` is a torch dtype name without the ``torch.`` prefix (``float32``, ``uint8``).
    ``xxh3``: XXH3-64 of the tensor's bytes, set on staged blocks; the receiver checks its copy.
    """

    name: Annotated[str, msgspec.Meta(max_length=MAX_TENSOR_NAME)]
    dtype: Annotated[str, msgspec.Meta(max_length=16)]
    shape: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_DIMS)]
    offset: NonNegative = 0
    nbytes: NonNegative = 0
    xxh3: Annotated[int, msgspec.Meta(ge=0)] | None = None  # msgpack carries at most 2**64 - 1


Manifest = Annotated[list[TensorSpec], msgspec.Meta(max_length=MAX_TENSORS)]


# --------------------------------------------------------------------------- client <-> daemon


class GenParams(Plain, forbid_unknown_fields=True):
    """What to generate. Validated against the registered models' limits before any work.

    The one struct that refuses unknown fields: skipping a field a client set would generate
    something else than asked for (``"scheduler": "euler"`` on the configured scheduler), so
    a field added here bumps ``PROTOCOL_VERSION`` instead.
    """

    prompt: Annotated[str, msgspec.Meta(max_length=16384)]
    negative_prompt: Annotated[str, msgspec.Meta(max_length=16384)] = ""
    width: Dim = 64
    height: Dim = 64
    frames: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    steps: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 20
    guidance: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 5.0
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0
    num_images: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
    output: Literal["png", "raw"] = "png"

    @property
    def pixels(self) -> int:
        """How many pixels it makes, every frame of every image counted."""
        return self.width * self.height * self.frames * self.num_images


# What the largest valid Submit encodes to, and a little more: its prompts at their longest in
# 4-byte UTF-8 characters (tests/unit/test_protocol.py builds it). The client socket's frame
# limit (daemon.client_max_message_bytes) may not go below it.
MAX_SUBMIT_BYTES = 136 * 1024


class Submit(Wire):
    """Ask for one generation. An empty ``request_id`` lets the daemon assign one."""

    protocol: int
    params: GenParams
    request_id: Annotated[str, msgspec.Meta(max_length=128)] = ""
    priority: Annotated[int, msgspec.Meta(ge=-100, le=100)] = 0
    # Seconds from receipt; None takes the daemon's default. Bounded so a typo cannot pin
    # slots for a day.
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] | None = None
    # Send ``Progress`` messages before the answer. Only for a client that can take several
    # replies to one request (DEALER): a REQ socket takes exactly one.
    progress: bool = False
    # Set: only a Cancel carrying the same token stops this request (its submitter's).
    # Empty: any Cancel naming its id does.
    cancel_token: CancelToken = ""


class Cancel(Wire):
    """Stop a request: queued work is dropped, running workers get an abort."""

    protocol: int
    request_id: RequestId
    cancel_token: CancelToken = ""  # the request's Submit.cancel_token


class StageTiming(Plain):
    """How long one stage of one request took, and where."""

    role: Role
    instance: str
    queued_ms: float
    compute_ms: float
    transfer_ms: float = 0.0  # pushing this stage's output to the next stage
    transfer_bytes: NonNegative = 0
    fast_path: bool | None = None  # None for the decoder, which has no outgoing hand-off
    via: Via | None = None  # None for the decoder


class Result(Wire):
    """A finished request. ``outputs[i]`` describes raw frame ``i`` after this header."""

    request_id: str
    outputs: Manifest
    stages: list[StageTiming]
    total_ms: float


class Rejected(Wire):
    """A request that will not produce a result, with a machine-readable reason."""

    request_id: str
    reason: Reason
    message: str


class Cancelled(Wire):
    """Acknowledges a ``Cancel``; the cancelled request itself gets ``Rejected(cancelled)``."""

    request_id: str
    found: bool
    # The id is in flight for a request whose Submit carried a cancel token this Cancel did
    # not: nothing was cancelled (found is false).
    refused: bool = False


class Progress(Wire):
    """Where a request that asked for it stands: at each stage it enters, when it has to wait
    for a stage's slot (with its place in the queue), and at most every ``progress_interval_s``
    of denoising, with the steps done. Never the last message about a request: its
    ``Result`` or ``Rejected`` is."""

    request_id: str
    # "encoding", "denoising" or "decoding"; "retrying" when an attempt failed in a way a
    # new one on other workers can mend (daemon.retries), which starts at "encoding" again.
    state: str
    elapsed_ms: float  # since the daemon took the submit (a retry's: since the first attempt's)
    step: NonNegative = 0  # denoising steps done so far (0 outside denoising)
    steps: NonNegative = 0  # of how many (0: not known yet)
    # Its place in the stage's queue when it had to wait for a slot (1: next); 0: not waiting.
    position: NonNegative = 0
    why: str = ""  # for "retrying": how the failed attempt ended
    # Estimated ms of work left until the Result, at the pace of the requests before it (its
    # own step rate while denoising), not counting waits for a slot; None until a request
    # has gone through every stage.
    eta_ms: float | None = None


ClientRequest = Submit | Cancel
ClientReply = Result | Rejected | Cancelled | Progress


# --------------------------------------------------------------------------- control


class GetStats(Wire):
    """Ask for a ``Stats`` snapshot."""


class ListWorkers(Wire):
    """Ask for every registered worker instance."""


class Drain(Wire):
    """Stop admitting, finish what is in flight, then exit (same as SIGTERM)."""


class InstanceStats(Plain):
    """One worker instance as its pool and the negotiator see it."""

    instance: str
    role: Role
    name: str
    address: str
    session: str
    slots_free: int
    slots_total: int
    prealloc_free: int
    prealloc_total: int
    served: int
    failed: int
    alive: bool
    # Taken by a stage run whose request ended (cancelled, timed out, failed elsewhere)
    # while it computed: held until the worker says the run is over.
    slots_finishing: int = 0
    # No new work: not yet reached by its Probe, or silent 2 heartbeats, or a push into it
    # failed, and not heard from since; or it said Stopping; or a push of its is overdue,
    # until it reports one.
    suspect: bool = False
    # What its model takes, as it registered them: the frontend admits only what every
    # registered worker takes, so the tightest of these is what clients may ask for.
    limits: StageLimits | None = None


# The upper bounds of the ``Latency`` buckets, in ms: from a sub-millisecond hand-off to a
# minutes-long video denoise.
LATENCY_BOUNDS_MS: tuple[float, ...] = (
    0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 300000,
)


class Latency(Plain):
    """How long one kind of thing took, every time since the daemon started: ``counts[i]``
    of them took at most ``LATENCY_BOUNDS_MS[i]`` and more than the bound before it; the
    last count, longer than every bound. ``total_ms``: their sum."""

    counts: list[NonNegative]
    total_ms: float


class Stats(Wire):
    """A snapshot gathered from the actors that own each number."""

    uptime_s: float
    draining: bool
    instances: list[InstanceStats]
    queue_depths: dict[str, int]
    handoffs_in_flight: int
    fast_path: dict[str, int]  # by hop, e.g. "encoder->denoiser"
    slow_path: dict[str, int]
    requests_by_state: dict[str, int]
    completed: int
    failed_by_reason: dict[str, int]
    late_reports: int  # worker reports dropped: late, or not the sender's to make
    mailboxes: dict[str, int]  # the most mail each actor's mailbox held at once
    # Mail each actor has handled since start: the daemon's internal hops (a request makes
    # about 25 on the fast path; the tracker's deadline tick adds 50 a second).
    mail_handled: dict[str, int] = {}
    # Requests started again because their worker was lost or their hand-off failed
    # (daemon.retries); the failed attempt also counts in failed_by_reason.
    retried: int = 0
    # Replies that could not be sent: the client had left, or was not reading with
    # daemon.client_send_hwm replies queued in ZMQ and client_held_bytes held by the daemon
    # (or client_held_total_bytes held for all clients together).
    replies_dropped: int = 0
    # Client messages refused at the door, by reason: submits never admitted (overloaded,
    # draining, duplicate, invalid, unsupported, cancelled: its Cancel came first), and any
    # message unreadable (invalid) or of another protocol (unsupported). Counted nowhere else.
    refused: dict[str, int] = {}
    # Completed requests ("request"), each stage's wait and compute ("encoder.queued",
    # "denoiser.compute", ...), each hop's write ("encoder->denoiser", ...); and the bytes
    # each hop moved, which over its latency's total_ms is its bandwidth.
    latency: dict[str, Latency] = {}
    handoff_bytes: dict[str, int] = {}
    # Hand-offs of requests that ended mid-push (not in handoffs_in_flight): their
    # receivers' memory waits for the push to report, or for push_quarantine_s.
    handoffs_held: int = 0


class Workers(Wire):
    """Every registered instance."""

    instances: list[InstanceStats]


class Draining(Wire):
    """Acknowledges ``Drain``."""

    in_flight: int


ControlRequest = GetStats | ListWorkers | Drain
ControlReply = Stats | Workers | Draining | Rejected


# --------------------------------------------------------------------------- worker <-> daemon


class SlotInfo(Plain):
    """A receive slot a worker carved from its pool at start, with its true size."""

    slot_id: NonNegative
    address: NonNegative
    size: Annotated[int, msgspec.Meta(gt=0)]


class StageLimits(Plain):
    """What a worker's model can honour; the daemon rejects requests outside them."""

    size_multiple: Annotated[int, msgspec.Meta(ge=1)] = 1
    min_size: Annotated[int, msgspec.Meta(ge=1)] = 8
    max_size: Annotated[int, msgspec.Meta(ge=1)] = 4096
    max_steps: Annotated[int, msgspec.Meta(ge=1)] = 1000
    min_steps: Annotated[int, msgspec.Meta(ge=1)] = 1
    max_images: Annotated[int, msgspec.Meta(ge=1)] = 16
    max_frames: Annotated[int, msgspec.Meta(ge=1)] = 1
    model: str = ""
    # width x height x frames x num_images: what one request may ask the stages to make.
    # Compute and memory grow with it, so sizes and counts each inside their bounds can
    # still add up to hours of work.
    max_pixels: Annotated[int, msgspec.Meta(ge=1)] = 4096 * 4096
    # Counts between min_steps and max_steps its scheduler cannot run (sorted): the counts
    # a scheduler takes need not be one run (orchestrator/stages/diffusion/families.py).
    step_gaps: Annotated[tuple[int, ...], msgspec.Meta(max_length=1000)] = ()


class LocalMemory(Plain):
    """How a peer on the same host maps a worker's pool: a shared file (memfd) it opens at
    ``path`` and checks by ``device``/``inode``, holding ``[base, base + size)``."""

    host: Label  # the kernel instance (boot id): equal only for workers of one host
    path: Label  # /proc/<pid>/fd/<fd>
    device: NonNegative
    inode: NonNegative
    base: NonNegative  # the pool's address in its owner, as registered
    size: NonNegative


class Register(Wire):
    """Worker -> daemon, first message on its DEALER. The connection becomes its identity."""

    protocol: int
    token: Label
    role: Role
    name: Label
    work_address: Label
    session: Label  # Mooncake segment name peers write to
    pool_base: NonNegative
    pool_size: NonNegative
    slots: Annotated[list[SlotInfo], msgspec.Meta(max_length=MAX_SLOTS)]
    capacity: Annotated[int, msgspec.Meta(ge=1, le=1024)]
    # How long its Mooncake waits for a write before giving up on it (its own copy's
    # MC_TRANSFER_TIMEOUT): the daemon times its pushes by it, and refuses a worker whose
    # writes could outlast push_quarantine_s, the memory's hold after a sender is lost.
    write_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=86400)]
    limits: StageLimits = StageLimits()
    local: LocalMemory | None = None  # the pool is shared memory peers on this host may write
    # What every worker of one daemon must share (``Stage.model_digest``): workers of two
    # models would hand each other tensors of the wrong shape or meaning.
    model_digest: Annotated[str, msgspec.Meta(max_length=64)] = ""


class Registered(Wire):
    """Daemon -> worker: accepted. ``key`` must prefix every work-socket message."""

    instance: str
    key: bytes
    heartbeat_s: float
    # The daemon's (each host's config copy may say its own): how long a receiver that
    # rejoins waits for writes it was sent before it was lost, and how long a sender
    # whose write is in doubt withholds Leaving.
    push_quarantine_s: float
    # The largest frame the daemon's socket takes (daemon.worker_max_message_bytes, which a
    # worker's own config may not share): a decoder refuses a larger output. 0: no limit said.
    max_message_bytes: NonNegative = 0


# RegisterRefused's message in a stopping daemon's farewell: a planned end, not an incident.
DAEMON_STOPPING = "the daemon is stopping"


class RegisterRefused(Wire):
    """Daemon -> worker: registration refused (bad token, version, slots), or a message on
    a connection the daemon does not know (it restarted, or evicted this worker)."""

    message: str
    # True for the unknown connection, for a daemon that stops, and for a registration
    # ``deferred`` (below): registering again is the cure, so the worker rejoins (keeping
    # its loaded stage) instead of exiting.
    rejoin: bool = False
    # No write the daemon ordered can still land in this worker's memory (its farewell; or
    # the answer to a worker evicted while nothing was being written into it): rejoining,
    # it need not wait out push_quarantine_s first.
    settled: bool = False
    # This registration is turned away for now (with rejoin): a live worker holds its name
    # or its Mooncake session, or the daemon has max_workers registered. Unlike the answers
    # to messages sent before the daemon forgot the worker, it says why the worker is not in
    # yet.
    deferred: bool = False


class Probe(Wire):
    """Daemon -> worker, the first order on its work socket. Until its ``Probed`` comes back
    the instance gets no work: a ``work_address`` the daemon cannot reach would otherwise
    look healthy (registered, heartbeating) while every order to it waits unread."""

    instance: str


class Probed(Wire):
    """Worker -> daemon: the ``Probe`` arrived, so orders reach this worker."""

    instance: str


class Heartbeat(Wire):
    """Worker -> daemon, every ``heartbeat_s``; silence past the timeout evicts the worker."""


class Stopping(Wire):
    """Worker -> daemon, as a worker is told to stop: send me no new work. Its requests go on
    until its Leaving, which follows once its runs have ended and its outputs are out."""


class Leaving(Wire):
    """Worker -> daemon, last words of a worker that stops (SIGTERM), sent once its stage and
    push threads have ended: forget me now, my requests can start again elsewhere."""


class Work(Wire):
    """Daemon -> encoder: run your stage for this request (no tensor input)."""

    request_id: str
    params: GenParams
    part: NonNegative = 0
    parts: Annotated[int, msgspec.Meta(ge=1)] = 1
    progress: bool = False  # report ``Step``s while computing
    priority: int = 0  # Submit.priority: requests held waiting for a compute thread go in by it


class Staged(Wire):
    """Worker -> daemon: output computed and staged in the registered pool."""

    request_id: str
    nbytes: NonNegative
    manifest: Manifest
    compute_ms: Millis
    part: NonNegative = 0


class Alloc(Wire):
    """Daemon -> receiver: make room for ``nbytes`` for this request (slow path)."""

    request_id: str
    nbytes: NonNegative


class Allocated(Wire):
    """Receiver -> daemon: room made at ``address`` in its registered pool."""

    request_id: str
    address: NonNegative


class AllocRejected(Wire):
    """Receiver -> daemon: cannot make room (larger than its general region, the pool less its
    receive slots, or none freed in time)."""

    request_id: str
    message: ErrorText


class Push(Wire):
    """Daemon -> sender: write your staged output to this receiver's memory."""

    request_id: str
    session: str
    address: NonNegative
    nbytes: NonNegative
    part: NonNegative = 0
    # The receiver's pool, when it shares the sender's host: copy there instead of a transfer.
    local: LocalMemory | None = None
    # Sent again in answer to the sender's ``Pushed(stood_still=True)``, so after its stall:
    # only a later stall of the sender makes it stale.
    after_stall: bool = False


class Pushed(Wire):
    """Sender -> daemon: the write finished (``ok``) or failed; the staged block is freed."""

    request_id: str
    ok: bool
    transfer_ms: Millis
    error: ErrorText = ""
    part: NonNegative = 0
    via: Via = "mooncake"
    # A failed write that timed out rather than ended: it may still land, so the receiver's
    # memory must wait out push_quarantine_s before anything else uses it.
    in_doubt: bool = False
    # Not written, and the staged output kept: the sender stood still around when it read
    # the Push, which may have been sent before the daemon gave up on it. The daemon sends
    # the Push again (``after_stall``) if its flight still holds that memory, else an Abort.
    stood_still: bool = False


class Ready(Wire):
    """Daemon -> receiver: your input landed at ``address``; run your stage."""

    request_id: str
    params: GenParams
    address: NonNegative
    manifest: Manifest
    slot_id: int | None = None  # the preallocated slot used, or None for an allocation
    progress: bool = False  # report ``Step``s while computing
    priority: int = 0  # Work.priority


class Done(Wire):
    """Worker -> daemon: stage ended without a hand-off: the decoder's result, or a failure.

    On success (decoder only) the raw output frames follow this header, one per ``outputs``.
    """

    request_id: str
    ok: bool
    compute_ms: Millis
    outputs: Manifest = []
    reason: Reason = Reason.STAGE_FAILED
    error: ErrorText = ""


# The reasons a stage's own failure may give; the daemon reads any other as stage_failed
# (a worker does not get to say "duplicate" or "worker_lost", which would mislead the
# client or start a retry).
STAGE_REASONS = frozenset({Reason.STAGE_FAILED, Reason.INVALID, Reason.TRANSFER_FAILED})


class Abort(Wire):
    """Daemon -> worker: drop this request and free everything it holds.

    ``ack`` is set when the daemon holds the worker's capacity slot until the request's stage
    run there has ended (an encoder or decoder pass cannot stop early, a denoiser stops at its
    next step): the worker answers ``Stopped`` with it then, or at once if nothing of the
    request runs there.
    """

    request_id: str
    ack: NonNegative | None = None


class Stopped(Wire):
    """Worker -> daemon: the stage run an ``Abort`` with ``ack`` stopped has ended."""

    request_id: str
    ack: NonNegative


class Step(Wire):
    """Worker -> daemon, for an order with ``progress``: ``step`` of ``steps`` are done.
    Sent at most every ``progress_interval_s`` (a worker setting), never after the stage ends."""

    request_id: str
    step: NonNegative
    steps: NonNegative


WorkerMessage = (
    Register | Probed | Heartbeat | Stopping | Leaving | Staged | Allocated | AllocRejected | Pushed | Done | Step
    | Stopped
)
DaemonToWorker = Registered | RegisterRefused
WorkOrder = Work | Alloc | Push | Ready | Abort | Probe


# --------------------------------------------------------------------------- codecs

ENCODER = msgspec.msgpack.Encoder()
CLIENT_REQUEST = msgspec.msgpack.Decoder(ClientRequest)
CLIENT_REPLY = msgspec.msgpack.Decoder(ClientReply)
CONTROL_REQUEST = msgspec.msgpack.Decoder(ControlRequest)
CONTROL_REPLY = msgspec.msgpack.Decoder(ControlReply)
WORKER_MESSAGE = msgspec.msgpack.Decoder(WorkerMessage)
DAEMON_TO_WORKER = msgspec.msgpack.Decoder(DaemonToWorker)
WORK_ORDER = msgspec.msgpack.Decoder(WorkOrder)

encode = ENCODER.encode

# What decoding bytes from a peer may raise: a malformed or invalid message (ValidationError
# is a DecodeError), or one nested deeper than the interpreter's recursion limit, which
# msgspec reaches even inside a field it skips (a 2 KB message). Catch all of them
# wherever a peer's bytes are decoded.
DECODE_ERRORS = (msgspec.DecodeError, RecursionError)


# The daemon's sockets, and what each takes in: a message sent to the wrong one is told where it goes.
_REQUESTS_BY_SOCKET = (("client", CLIENT_REQUEST), ("control", CONTROL_REQUEST), ("worker", WORKER_MESSAGE))


class _Head(msgspec.Struct):
    """What any version's opening message states, read whatever else it holds."""

    protocol: int | None = None
    request_id: str = ""


_HEAD_OF = msgspec.msgpack.Decoder(_Head)


def _head(body: bytes) -> _Head | None:
    try:
        return _HEAD_OF.decode(body)
    except DECODE_ERRORS:
        return None


def other_version(body: bytes) -> int | None:
    """The protocol version ``body`` states, if it states one other than this build's: its
    other fields may not decode here at all (one added since is missing, or one this build
    lacks: GenParams refuses those), and the version is then what to tell its sender. None
    for this version, or no readable one."""
    head = _head(body)
    stated = head.protocol if head is not None else None
    return stated if stated not in (None, PROTOCOL_VERSION) else None


def stated_request_id(body: bytes) -> str:
    """The request id ``body`` states, if it is one a reply can carry; else ""."""
    head = _head(body)
    return head.request_id if head is not None and 0 < len(head.request_id) <= MAX_REQUEST_ID else ""


def wrong_socket(here: str, body: bytes) -> str | None:
    """What the daemon's ``here`` socket ("client", "control" or "worker") answers a peer
    whose message ``body`` is meant for another of its sockets; None if it is not."""
    for socket, decoder in _REQUESTS_BY_SOCKET:
        try:
            decoder.decode(body)
        except DECODE_ERRORS:
            continue
        if socket == here:
            return None
        return (f"this is the daemon's {here} socket; this message goes to its {socket} socket "
                f"(daemon.{socket}_endpoint)")
    return None


def brief(text: str) -> str:
    """``text`` cut to what an ``ErrorText`` holds."""
    return text if len(text) <= MAX_ERROR_TEXT else text[: MAX_ERROR_TEXT - 1] + "…"


def hop_name(sender: Role, receiver: Role) -> str:
    return f"{sender}->{receiver}"


def next_role(role: Role) -> Role | None:
    """The stage that consumes ``role``'s output, or None after the decoder."""
    index = ROLES.index(role)
    return ROLES[index + 1] if index + 1 < len(ROLES) else None
