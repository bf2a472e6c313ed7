"""DoorLimits: the door checks every registered worker's limits, of every role."""

from __future__ import annotations

from actors.door import DoorLimits
from transfer.protocol import GenParams, StageLimits

WIDE = StageLimits(max_size=64, model="m")
NARROW = StageLimits(max_size=32, model="m")
ASK_48 = GenParams(prompt="p", width=48, height=16)


def test_nothing_registered_admits_anything() -> None:
    assert DoorLimits().violation(ASK_48) is None


def test_the_tightest_worker_of_a_role_binds_whatever_registered_last() -> None:
    door = DoorLimits()
    door.joined("denoiser", "denoiser-1", NARROW)
    door.joined("denoiser", "denoiser-2", WIDE)
    assert door.violation(ASK_48) == "width 48 is outside [8, 32] for model 'm'"
    door.left("denoiser", "denoiser-1")
    assert door.violation(ASK_48) is None


def test_every_role_binds() -> None:
    door = DoorLimits()
    door.joined("denoiser", "denoiser-1", WIDE)
    door.joined("decoder", "decoder-1", NARROW)
    assert door.violation(ASK_48) is not None


def test_a_role_whose_last_worker_left_keeps_its_limits_until_another_registers() -> None:
    door = DoorLimits()
    door.joined("denoiser", "denoiser-1", NARROW)
    door.left("denoiser", "denoiser-1")
    assert door.violation(ASK_48) is not None  # a restart: its replacement runs the same config
    door.joined("denoiser", "denoiser-2", WIDE)
    assert door.violation(ASK_48) is None
    door.left("denoiser", "unknown-instance")  # no harm
    assert door.violation(ASK_48) is None


def test_the_first_worker_after_none_at_all_forgets_the_departed_limits() -> None:
    """It may bring another model (the daemon takes one while no worker is registered):
    the old model's limits must not bind the new one's requests."""
    door = DoorLimits()
    door.joined("denoiser", "denoiser-1", NARROW)
    door.joined("decoder", "decoder-1", NARROW)
    door.left("denoiser", "denoiser-1")
    door.left("decoder", "decoder-1")
    door.joined("encoder", "encoder-2", WIDE)
    assert door.violation(ASK_48) is None


def test_the_roles_no_worker_serves_are_known() -> None:
    door = DoorLimits()
    assert door.unserved() == ["encoder", "denoiser", "decoder"]
    door.joined("encoder", "encoder-1", WIDE)
    door.joined("decoder", "decoder-1", WIDE)
    assert door.unserved() == ["denoiser"]
    door.left("decoder", "decoder-1")
    assert door.unserved() == ["denoiser", "decoder"]
