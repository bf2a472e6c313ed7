"""One request's journey through the stages, as the negotiator tracks it.

    RUNNING --staged--> AWAITING --slot free---------------------------> PUSHING --pushed--> RUNNING (next role)
                            |--no slot--------------> ALLOCATING --allocated^
                            \\--only a slot fits--> SLOT_WAIT --slot freed^

SLOT_WAIT: the output is larger than the receiver's general region, so only one of its
preallocated slots can take it, and none is free yet; one frees as a request it holds moves on.

``role``/``instance`` name the stage that is computing (RUNNING) or sending (the rest);
``receiver`` is the next stage's instance once one is reserved.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from actors.slots import Slot
from transfer.protocol import GenParams, Role, TensorSpec, next_role


class FlightState(enum.StrEnum):
    RUNNING = "running"
    AWAITING = "awaiting_receiver"
    ALLOCATING = "allocating"
    SLOT_WAIT = "awaiting_slot"
    PUSHING = "pushing"


ALLOWED: dict[FlightState, frozenset[FlightState]] = {
    FlightState.RUNNING: frozenset({FlightState.AWAITING}),
    FlightState.AWAITING: frozenset({FlightState.PUSHING, FlightState.ALLOCATING, FlightState.SLOT_WAIT}),
    FlightState.ALLOCATING: frozenset({FlightState.PUSHING}),
    FlightState.SLOT_WAIT: frozenset({FlightState.PUSHING}),
    FlightState.PUSHING: frozenset({FlightState.RUNNING}),
}


@dataclass(slots=True, kw_only=True)
class Flight:
    request_id: str
    params: GenParams
    role: Role
    instance: str
    deadline: float  # Job.deadline, carried into the next stage's job
    priority: int = 0  # carried into the next stage's job
    progress: bool = False  # its client wants progress: every stage's order says so
    avoid: frozenset[str] = frozenset()  # Job.avoid, carried into the next stage's job
    again: bool = False  # Job.again, carried into the next stage's job
    state: FlightState = FlightState.RUNNING
    input_slot: Slot | None = None  # preallocated slot holding the running stage's input
    nbytes: int = 0
    manifest: list[TensorSpec] | None = None
    compute_ms: float = 0.0
    staged_at: float = 0.0  # monotonic: when its output began waiting for the next role
    waited_ms: float = 0.0  # from then until a receiver was reserved (and, in SLOT_WAIT, a slot freed there)
    receiver: str | None = None  # an instance of the role after ``role``
    slot: Slot | None = None  # fast path: the receiver's preallocated slot
    address: int = 0
    push_due: float = 0.0  # pushing: by when (monotonic) its sender should have reported the write
    doomed: bool = False  # the request ended mid-push; freed when the push reports, or at quarantine_ends
    quarantine_ends: float = 0.0  # doomed: when its receiver's memory is freed if no report frees it first
    in_doubt: bool = False  # its push reported a timeout: it may still land, so only the quarantine frees it
    abort_receiver: bool = False  # doomed, and the receiver said it holds more: abort it with its memory
    stalled_pushes: int = 0  # pushes its sender refused for a stall (Pushed(stood_still)), nothing written

    def _move(self, new: FlightState) -> None:
        if new not in ALLOWED[self.state]:
            raise RuntimeError(f"flight {self.request_id}: {self.state} -> {new}")
        self.state = new

    def stage_output(self, nbytes: int, manifest: list[TensorSpec], compute_ms: float, *, at: float) -> None:
        self._move(FlightState.AWAITING)
        self.nbytes, self.manifest, self.compute_ms, self.staged_at = nbytes, manifest, compute_ms, at

    @property
    def receiver_role(self) -> Role:
        role = next_role(self.role)
        assert role is not None, f"flight {self.request_id}: a decoder's output goes to its client"
        return role

    def reserve(self, receiver: str, *, slot: Slot | None, address: int | None, at: float) -> None:
        self.receiver, self.slot = receiver, slot
        self.waited_ms = (at - self.staged_at) * 1000
        if address is None:
            self._move(FlightState.ALLOCATING)
        else:
            self.address = address
            self._move(FlightState.PUSHING)

    def wait_for_slot(self, receiver: str) -> None:
        """``receiver`` is reserved, but only one of its preallocated slots can hold the output,
        and none is free yet."""
        self._move(FlightState.SLOT_WAIT)
        self.receiver = receiver

    def take_slot(self, slot: Slot, *, at: float) -> None:
        if self.state != FlightState.SLOT_WAIT:
            raise RuntimeError(f"flight {self.request_id}: a slot taken while {self.state}")
        self._move(FlightState.PUSHING)
        self.slot, self.address = slot, slot.address
        self.waited_ms = (at - self.staged_at) * 1000

    def allocated(self, address: int) -> None:
        if self.state != FlightState.ALLOCATING:
            raise RuntimeError(f"flight {self.request_id}: allocated while {self.state}")
        self.address = address
        self._move(FlightState.PUSHING)

    def delivered(self) -> None:
        """The receiver now runs the request; its slot holds the input until it stages."""
        assert self.receiver is not None
        self._move(FlightState.RUNNING)
        self.role, self.instance, self.input_slot = self.receiver_role, self.receiver, self.slot
        self.receiver = self.slot = None
        self.manifest = None
