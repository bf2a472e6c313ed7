"""The request state table and a request's flight between stages."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from actors.flight import ALLOWED as FLIGHT_ALLOWED
from actors.flight import Flight, FlightState
from actors.slots import Slot
from actors.states import ACTIVE_BY_ROLE, ALLOWED, IllegalTransition, RequestState, check_move
from transfer.protocol import ROLES, GenParams, TensorSpec, next_role

TERMINAL = {RequestState.DONE, RequestState.FAILED}
MANIFEST = [TensorSpec(name="embeds", dtype="float32", shape=(4,), nbytes=16)]

# --------------------------------------------------------------------------- request states


def test_table_covers_every_state() -> None:
    assert set(ALLOWED) == set(RequestState)


def test_terminal_states_have_no_exits() -> None:
    for state in TERMINAL:
        assert ALLOWED[state] == frozenset()


def test_every_active_state_can_fail() -> None:
    for state in set(RequestState) - TERMINAL:
        assert RequestState.FAILED in ALLOWED[state]


def test_active_states_follow_the_pipeline() -> None:
    """Each role's active state leads to the next role's, and the decoder's to DONE."""
    for role in ROLES:
        following = next_role(role)
        target = ACTIVE_BY_ROLE[following] if following else RequestState.DONE
        check_move(ACTIVE_BY_ROLE[role], target)


# The lifecycles written out here, not read from the code, so a wrong table fails.
REQUEST_MOVES = {
    ("encoding", "denoising"), ("denoising", "decoding"), ("decoding", "done"),
    ("encoding", "failed"), ("denoising", "failed"), ("decoding", "failed"),
}
FLIGHT_MOVES = {
    FlightState.RUNNING: {FlightState.AWAITING},  # its stage ran: output staged
    # fast path, slow path, or (larger than the receiver's region) wait for one of its slots
    FlightState.AWAITING: {FlightState.PUSHING, FlightState.ALLOCATING, FlightState.SLOT_WAIT},
    FlightState.ALLOCATING: {FlightState.PUSHING},
    FlightState.SLOT_WAIT: {FlightState.PUSHING},
    FlightState.PUSHING: {FlightState.RUNNING},  # pushed: the next stage runs
}


@pytest.mark.parametrize(("current", "new"), list(itertools.product(RequestState, RequestState)))
def test_exactly_the_pipelines_moves_are_allowed(current: RequestState, new: RequestState) -> None:
    if (current, new) in REQUEST_MOVES:
        check_move(current, new)
    else:
        with pytest.raises(IllegalTransition, match=f"{current} -> {new}"):
            check_move(current, new)


# --------------------------------------------------------------------------- flights


def flight(**overrides: object) -> Flight:
    fields = {"request_id": "r1", "params": GenParams(prompt="p"), "role": "encoder", "instance": "encoder-1",
              "deadline": math.inf}
    return Flight(**(fields | overrides))


def slot(instance: str = "denoiser-2", slot_id: int = 0) -> Slot:
    return Slot(instance, slot_id, address=4096 * (slot_id + 1), size=4096)


def test_fast_path_goes_running_awaiting_pushing_running() -> None:
    f = flight()
    f.stage_output(16, MANIFEST, 1.5, at=10.0)
    assert (f.state, f.nbytes, f.manifest, f.compute_ms) == (FlightState.AWAITING, 16, MANIFEST, 1.5)
    s = slot()
    f.reserve("denoiser-2", slot=s, address=s.address, at=10.25)
    assert (f.state, f.address) == (FlightState.PUSHING, s.address)
    assert f.waited_ms == 250.0  # for the denoiser's slot, from staging to the reservation
    f.delivered()
    assert f.state == FlightState.RUNNING


def test_slow_path_goes_through_allocating() -> None:
    f = flight()
    f.stage_output(16, MANIFEST, 1.0, at=10.0)
    f.reserve("denoiser-2", slot=None, address=None, at=10.0)
    assert f.state == FlightState.ALLOCATING
    f.allocated(12345)
    assert (f.state, f.address) == (FlightState.PUSHING, 12345)


def test_delivered_moves_the_receivers_slot_into_input_slot() -> None:
    f = flight()
    f.stage_output(16, MANIFEST, 1.0, at=10.0)
    s = slot()
    f.reserve("denoiser-2", slot=s, address=s.address, at=10.0)
    f.delivered()
    assert (f.role, f.instance, f.input_slot) == ("denoiser", "denoiser-2", s)
    assert (f.receiver, f.slot, f.manifest) == (None, None, None)


def test_delivered_after_allocation_leaves_no_input_slot() -> None:
    f = flight(input_slot=slot("encoder-1"))
    f.stage_output(16, MANIFEST, 1.0, at=10.0)
    f.reserve("denoiser-2", slot=None, address=None, at=10.0)
    f.allocated(99)
    f.delivered()
    assert f.input_slot is None


def test_allocated_while_running_is_illegal() -> None:
    with pytest.raises(RuntimeError, match="flight r1"):
        flight().allocated(1)


def test_stage_output_while_awaiting_is_illegal() -> None:
    f = flight()
    f.stage_output(16, MANIFEST, 1.0, at=10.0)
    with pytest.raises(RuntimeError, match="awaiting_receiver -> awaiting_receiver"):
        f.stage_output(16, MANIFEST, 1.0, at=10.0)


def test_allocated_while_awaiting_is_illegal() -> None:
    """No receiver was reserved, so nothing can have been allocated: the flight must refuse."""
    f = flight()
    f.stage_output(16, MANIFEST, 1.0, at=10.0)
    with pytest.raises(RuntimeError):
        f.allocated(1)


def test_allocated_on_the_fast_path_is_illegal() -> None:
    f = flight()
    f.stage_output(16, MANIFEST, 1.0, at=10.0)
    f.reserve("denoiser-2", slot=slot(), address=4096, at=10.0)
    with pytest.raises(RuntimeError, match="flight r1"):
        f.allocated(1)


def test_reserve_while_running_is_illegal() -> None:
    with pytest.raises(RuntimeError):
        flight().reserve("denoiser-2", slot=None, address=None, at=10.0)


def test_flight_table_is_the_hand_off_lifecycle() -> None:
    assert FLIGHT_ALLOWED == FLIGHT_MOVES


class FlightMachine(RuleBasedStateMachine):
    """Random calls on one Flight: legal ones follow the table, illegal ones raise and keep the state."""

    def __init__(self) -> None:
        super().__init__()
        self.flight = flight()
        self.model = FlightState.RUNNING
        self.role_index = 0

    def _call(self, target: FlightState | None, action) -> None:  # type: ignore[no-untyped-def]
        before = self.flight.state
        if target in FLIGHT_MOVES[self.model]:
            action()
            self.model = target
        else:
            with pytest.raises(RuntimeError):
                action()
            assert self.flight.state == before

    @rule(nbytes=st.integers(0, 1 << 20))
    def stage_output(self, nbytes: int) -> None:
        self._call(FlightState.AWAITING, lambda: self.flight.stage_output(nbytes, MANIFEST, 1.0, at=10.0))

    @precondition(lambda self: self.role_index < 2)
    @rule(fast=st.booleans())
    def reserve(self, fast: bool) -> None:
        receiver_role = ROLES[self.role_index + 1]
        s = slot(f"{receiver_role}-1") if fast else None
        target = FlightState.PUSHING if fast else FlightState.ALLOCATING
        self._call(target, lambda: self.flight.reserve(f"{receiver_role}-1", slot=s,
                                                        address=s.address if s else None, at=10.0))

    @precondition(lambda self: self.role_index < 2)
    @rule()
    def wait_for_slot(self) -> None:
        receiver_role = ROLES[self.role_index + 1]
        self._call(FlightState.SLOT_WAIT, lambda: self.flight.wait_for_slot(f"{receiver_role}-1"))

    @precondition(lambda self: self.role_index < 2)
    @rule()
    def take_slot(self) -> None:
        target = FlightState.PUSHING if self.model == FlightState.SLOT_WAIT else None
        self._call(target, lambda: self.flight.take_slot(slot(f"{ROLES[self.role_index + 1]}-1"), at=10.0))

    # From AWAITING, allocated() is covered by test_allocated_while_awaiting_is_illegal.
    @precondition(lambda self: self.model != FlightState.AWAITING)
    @rule(address=st.integers(0, 1 << 30))
    def allocated(self, address: int) -> None:
        target = FlightState.PUSHING if self.model == FlightState.ALLOCATING else None
        self._call(target, lambda: self.flight.allocated(address))

    @precondition(lambda self: self.model == FlightState.PUSHING)
    @rule()
    def delivered(self) -> None:
        self.flight.delivered()
        self.model = FlightState.RUNNING
        self.role_index += 1

    @invariant()
    def state_matches_model(self) -> None:
        assert self.flight.state == self.model

    @invariant()
    def running_flight_names_its_stage(self) -> None:
        if self.flight.state == FlightState.RUNNING:
            assert self.flight.role == ROLES[self.role_index]


TestFlightMachine = FlightMachine.TestCase
TestFlightMachine.settings = settings(max_examples=50, stateful_step_count=20, deadline=None)
