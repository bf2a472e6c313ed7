"""What a worker's registration must satisfy, and which addresses a link's pool holds."""

from __future__ import annotations

import msgspec
import pytest

from actors.links import Link, model_problem, registration_problem
from transfer.protocol import PROTOCOL_VERSION, LocalMemory, Register, SlotInfo, StageLimits

BASE, SIZE = 1 << 20, 4096
QUARANTINE_S = 6.0
GOOD = Register(protocol=PROTOCOL_VERSION, token="secret", role="denoiser", name="d0", work_address="ipc://w",
                session="127.0.0.1:1", pool_base=BASE, pool_size=SIZE, capacity=2, write_timeout_s=5.0,
                slots=[SlotInfo(slot_id=0, address=BASE, size=1024),
                       SlotInfo(slot_id=1, address=BASE + 3072, size=1024)])


def test_a_good_registration_has_no_problem() -> None:
    assert registration_problem(GOOD, "secret", QUARANTINE_S) is None
    shared = LocalMemory(host="h", path="/proc/1/fd/3", device=1, inode=2, base=BASE, size=SIZE)
    assert registration_problem(msgspec.structs.replace(GOOD, local=shared), "secret", QUARANTINE_S) is None


@pytest.mark.parametrize(("change", "problem"), [
    ({"token": "guess"}, "bad token: this worker's daemon.token is not the daemon's"),
    ({"protocol": PROTOCOL_VERSION + 1}, f"protocol {PROTOCOL_VERSION + 1}, daemon speaks {PROTOCOL_VERSION}"),
    ({"slots": [SlotInfo(slot_id=7, address=BASE + 3584, size=1024)]}, "slots [7] lie outside the registered pool"),
    ({"slots": [SlotInfo(slot_id=7, address=BASE - 1, size=8)]}, "slots [7] lie outside the registered pool"),
    ({"slots": [SlotInfo(slot_id=0, address=BASE, size=1024), SlotInfo(slot_id=0, address=BASE + 2048, size=8)]},
     "slot ids repeat or slots overlap"),
    ({"slots": [SlotInfo(slot_id=0, address=BASE, size=1024), SlotInfo(slot_id=1, address=BASE + 1023, size=8)]},
     "slot ids repeat or slots overlap"),
    ({"local": LocalMemory(host="h", path="/proc/1/fd/3", device=1, inode=2, base=BASE, size=SIZE * 2)},
     "the shared memory it advertises is not its registered pool"),
    # Its host's copy of the config said its own Mooncake timeout; the daemon's file never saw it.
    ({"write_timeout_s": QUARANTINE_S}, f"this worker's Mooncake write timeout ({QUARANTINE_S:g} s, transfer.env."
                                        f"MC_TRANSFER_TIMEOUT) is not below the daemon's push_quarantine_s "
                                        f"({QUARANTINE_S:g} s): a write it gave up on could land in memory already "
                                        "given to another request; lower the one or raise the other"),
])
def test_each_broken_rule_is_named(change: dict, problem: str) -> None:
    assert registration_problem(msgspec.structs.replace(GOOD, **change), "secret", QUARANTINE_S) == problem


def test_a_link_holds_only_ranges_inside_its_pool() -> None:
    link = Link(b"id", "denoiser-1", "denoiser", "d0", "s", BASE, SIZE, "ipc://w", joined_at=0.0, last_seen=0.0)
    assert link.holds(BASE, SIZE) and link.holds(BASE + SIZE - 1, 1)
    assert not link.holds(BASE - 1, 1) and not link.holds(BASE + SIZE - 1, 2)


def serving(name: str, digest: str) -> Link:
    return Link(b"id", "encoder-1", "encoder", name, "s", BASE, SIZE, "ipc://e", joined_at=0.0, last_seen=0.0,
                limits=StageLimits(model="tiny-sd15"), model_digest=digest)


def test_a_worker_joins_only_workers_of_its_own_model() -> None:
    mine = msgspec.structs.replace(GOOD, model_digest="aa", limits=StageLimits(model="tiny-sd15"))
    assert model_problem(mine, []) is None  # the first sets the model
    assert model_problem(mine, [serving("e0", "aa")]) is None
    assert model_problem(msgspec.structs.replace(mine, model_digest="bb"), [serving("e0", "aa")]) == (
        "this worker's model 'tiny-sd15' (digest bb) is not the model the registered workers serve, "
        "'tiny-sd15' (digest aa): every worker of a daemon must load the same model (family, configs, "
        "tiny seed); to change models, stop every worker first")
    # A restart under its own name is compared with the others only.
    assert model_problem(msgspec.structs.replace(mine, model_digest="bb"), [serving("d0", "aa")]) is None
