"""In-process messages between the daemon's actors: one tagged union per inbox.

Never encoded. Each actor owns its state and learns about the rest only through these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import msgspec
from anyio.abc import ObjectSendStream

from transfer.protocol import ClientReply, GenParams, Reason, Role, StageLimits, TensorSpec, Via, WorkOrder


class Mail(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Base of in-process messages."""


class Job(msgspec.Struct, frozen=True, kw_only=True):
    """A request waiting for, or holding, capacity at one role."""

    request_id: str
    role: Role
    params: GenParams
    # When the tracker will time it out (time.monotonic()): a job still queued then is
    # never started, even in the moments before the tracker's next tick ends it.
    deadline: float
    priority: int = 0  # Submit.priority: higher is served first at every role
    progress: bool = False  # Submit.progress: the workers report their steps
    # For a retry: the instances its failed attempts involved. The pools place it elsewhere
    # when another instance has room, so a worker that broke it once does not get it again.
    avoid: frozenset[str] = frozenset()
    # A retry: it waited its turn once already, so at every role it queues before the jobs
    # of its priority that have not had one, rather than spend what is left of its deadline queued.
    again: bool = False
    # The size of its input (the previous stage's staged output); 0 at the encoder. Only a
    # worker whose memory can ever hold it is offered the job.
    nbytes: int = 0


class QueryStats(Mail):
    """Answer with your own numbers on ``reply`` (one slot; the replier closes it)."""

    reply: ObjectSendStream[Any]


class Forget(Mail):
    """``request_id`` is over: each owner frees what it holds, then passes this on
    (tracker -> admission -> pools -> negotiator)."""

    request_id: str


class Tick(Mail):
    """Time passed: check deadlines or liveness. ``gap_s``: the time since the previous tick
    (0: not measured); far past its period, the event loop, and with it every socket's
    reader, stood still for up to that long."""

    gap_s: float = 0.0


# --------------------------------------------------------------------------- frontend


class Deliver(Mail):
    """Send ``message`` (then ``frames``, relayed untouched) to whoever asked ``request_id``.
    A ``Progress`` leaves the request in flight; any other message is its answer."""

    request_id: str
    message: ClientReply
    frames: Sequence[Any] = ()
    avoid: frozenset[str] = frozenset()  # for a failure: the instances it implicates (Failed.avoid)


class SetDraining(Mail):
    """Answer new submits with ``draining`` from now on."""


class LimitsChanged(Mail):
    """A worker of ``role`` registered with these model limits, or left (``limits`` None)."""

    role: Role
    instance: str
    limits: StageLimits | None


FrontendMail = Deliver | SetDraining | LimitsChanged | QueryStats


# --------------------------------------------------------------------------- tracker


class Admit(Mail):
    """A validated submit: start tracking it and queue it for an encoder."""

    request_id: str
    params: GenParams
    timeout_s: float
    # When the client's submit arrived (monotonic), for a retry the first attempt's: its
    # Progress and its Result's total_ms count from there.
    submitted_at: float
    priority: int = 0
    progress: bool = False
    avoid: frozenset[str] = frozenset()  # Job.avoid
    again: bool = False  # Job.again


class HandedOff(Mail):
    """A stage's output reached the next stage's memory."""

    request_id: str
    role: Role
    instance: str
    compute_ms: float
    transfer_ms: float
    nbytes: int
    fast_path: bool
    via: Via = "mooncake"
    # How long the output waited for the next role's slot: that role's queueing, not this one's.
    waited_ms: float = 0.0


class Finished(Mail):
    """The decoder answered; ``frames`` are its raw output frames."""

    request_id: str
    instance: str
    compute_ms: float
    outputs: list[TensorSpec]
    frames: Sequence[Any]


class Failed(Mail):
    """The request cannot finish; every owner will be told to forget it."""

    request_id: str
    reason: Reason
    message: str
    avoid: frozenset[str] = frozenset()  # the instances the failure implicates: a retry prefers others


BY_THE_CLIENT = "cancelled by the client"
CLIENT_GONE = "its client's connection closed"  # the daemon cancelled it: its reply has nowhere to go

# Failures that a fresh attempt can mend (daemon.retries). The retry avoids the instances
# the failure implicated (Deliver.avoid) wherever others have room.
RETRIED = frozenset({Reason.WORKER_LOST, Reason.TRANSFER_FAILED})


class CancelRequest(Mail):
    request_id: str
    why: str = BY_THE_CLIENT


class Queued(Mail):
    """A job that asked for progress found no free slot at ``role``: it is ``position`` in line (1: next)."""

    request_id: str
    role: Role
    position: int


class Stepped(Mail):
    """The computing instance reported ``step`` of ``steps`` done."""

    request_id: str
    step: int
    steps: int


class StartDrain(Mail):
    """Stop admitting; set ``drained`` once nothing is in flight."""

    drained: anyio.Event


class EndAll(Mail):
    """The drain ran out of time: fail every request still in flight with ``message``."""

    message: str


TrackerMail = (
    Admit | HandedOff | Finished | Failed | CancelRequest | Queued | Stepped | StartDrain | EndAll | Tick
    | QueryStats
)


# --------------------------------------------------------------------------- admission


class Enqueue(Mail):
    """Queue ``job`` until its role has capacity; ``front``: a job that lost its slot goes
    before those of its priority that have not had a turn (as a retry's does: ``Job.again``)."""

    job: Job
    front: bool = False


class Credit(Mail):
    """``role`` gained (or, negative, lost) ``delta`` free slots."""

    role: Role
    delta: int


AdmissionMail = Enqueue | Credit | Forget | QueryStats


# --------------------------------------------------------------------------- pools


class Dispatch(Mail):
    """Admission granted ``job`` a slot of this role: pick an instance."""

    job: Job


class Join(Mail):
    """A worker registered: add it to the pool and connect to its work socket."""

    instance: str
    name: str
    work_address: str
    session: str
    key: bytes
    capacity: int
    # The largest input it can ever take in one hand-off (its largest preallocated slot, or
    # its general region); 0 for an encoder, whose inputs come with its orders.
    fits: int = 0
    limits: StageLimits = StageLimits()  # Register.limits: the requests it takes


class Leave(Mail):
    """A worker is gone (evicted or replaced): fail what it held (``worker_lost``), forget it."""

    instance: str
    message: str


class Suspect(Mail):
    """``instance`` went quiet or a push into it failed (``suspect``), or it has been heard
    from since: while suspected it gets no new work, so a dead worker cannot take request
    after request until its heartbeats are missed."""

    instance: str
    suspect: bool


class Send(Mail):
    """Send ``order`` to ``instance``'s work socket."""

    instance: str
    order: WorkOrder


class Release(Mail):
    """``instance`` no longer holds ``request_id``: its slot is free.

    ``ok`` counts the stage as served (True) or failed (False); None returns a reservation
    that was never used. ``finishing``: the request ended while its stage ran there, and
    the run goes on until its next step or the end of its pass: the slot stays taken, no
    longer the request's, until the ``RunEnded`` that says the run is over.
    """

    request_id: str
    instance: str
    ok: bool | None
    finishing: bool = False


class RunEnded(Mail):
    """A run ``Release(finishing=True)`` left holding a slot of ``instance`` has ended."""

    instance: str


PoolMail = Dispatch | Join | Leave | Suspect | Send | Release | RunEnded | Forget | QueryStats


# --------------------------------------------------------------------------- negotiator


class Placed(Mail):
    """A receiver pool reserved a slot at ``instance`` for ``job``'s input."""

    job: Job
    instance: str


class Stuck(Mail):
    """An instance's work socket is full (SNDHWM): it takes no orders, so it must go, and
    come back clean (its rejoin frees what the lost orders would have freed)."""

    instance: str
    message: str


class Farewell(Mail):
    """The daemon stops: tell every worker to rejoin its successor, and no one else to join."""


NegotiatorMail = Placed | Forget | Tick | Stuck | Farewell | QueryStats
