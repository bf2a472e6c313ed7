"""MooncakeEngine over real loopback TCP (the TransferConfig defaults force TCP).

Two engines in one process work, so the sender and the main receiver live here. Peers that
get rejected writes or get killed run in a subprocess: rejections tear down the sender's
lanes to that peer, and a killed process is the honest way to get a dead peer. Dropping an
in-process engine holds the GIL for about a second, so engines are shared per module.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch

import transfer.engine
from orchestrator.config import TransferConfig, transfer_timeout_s
from transfer.engine import Engine, MooncakeEngine, TransferError, TransferInDoubt
from transfer.pool import MemoryPool
from transfer.shm import SharedRegion

CFG = TransferConfig()
POOL_BYTES = 1 << 20
SLOT_BYTES = 300_001  # odd on purpose: slots keep their true size

# A foreign peer: bare Mooncake and a ctypes buffer (no torch, so it starts in ~60 ms).
PEER = """
import ctypes, json, sys
from mooncake.engine import TransferEngine
te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = ctypes.create_string_buffer(SIZE)
assert te.register_memory(ctypes.addressof(buf), SIZE) == 0
print(json.dumps({"session": f"127.0.0.1:{te.get_rpc_port()}", "address": ctypes.addressof(buf)}), flush=True)
sys.stdin.read()  # live until the test closes stdin or kills us
"""


@dataclass
class Pair:
    sender: MooncakeEngine
    receiver: MooncakeEngine
    out: MemoryPool  # registered with the sender
    inbox: MemoryPool  # registered with the receiver, one prealloc slot


@dataclass
class Peer:
    session: str
    address: int
    size: int
    process: subprocess.Popen[str]


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    sender, receiver = MooncakeEngine(CFG), MooncakeEngine(CFG)
    out = MemoryPool(POOL_BYTES)
    inbox = MemoryPool(POOL_BYTES, slot_sizes=(SLOT_BYTES,))
    sender.register(out.base, out.size)
    receiver.register(inbox.base, inbox.size)
    yield Pair(sender, receiver, out, inbox)
    sender.close()
    receiver.close()


@pytest.fixture
def peer() -> Iterator[Peer]:
    size = 1 << 16
    env = {**os.environ, **CFG.env}
    with subprocess.Popen(
        [sys.executable, "-c", PEER.replace("SIZE", str(size))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    ) as process:
        try:
            assert process.stdout is not None
            info = json.loads(process.stdout.readline())
            yield Peer(info["session"], info["address"], size, process)
        finally:
            process.kill()


def stop(process: subprocess.Popen[str]) -> None:
    """SIGSTOP, and wait until the kernel reports the process stopped (state T)."""
    process.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with open(f"/proc/{process.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError("peer did not stop")


_OPENED = 0x4000  # the id of the fake's empty writes


class ScriptedMooncake:
    """Hands out ids and answers each poll from a per-id script of statuses.

    Fails the test if an id is polled after it returned 1 or -1 (Mooncake has freed it by
    then) or after -2, or if an id is polled that was never handed out (both segfault)."""

    def __init__(self, *scripts: Sequence[int], submit_s: float = 0.0, open_s: float = 0.0, refused_opens: int = 0,
                 refused_id: int = 0) -> None:
        self.scripts = [list(script) for script in scripts]  # [] means "submit fails (refused_id)"
        self.submit_s = submit_s  # how long each submit takes
        self.open_s = open_s  # how long opening a peer's segment (its handshake) takes
        self.refused_opens = refused_opens  # how many of the first empty writes fail (0: the peer is not open)
        self.refused_id = refused_id  # what a failed submit returns: 0, or an id no real one can be
        self.opens = 0
        self.submits = 0
        self.polls: dict[int, int] = {}
        self.finished: set[int] = set()

    def transfer_submit_write(self, session: str, src: int, dst: int, nbytes: int) -> int:
        if nbytes == 0:  # the empty write that opens a peer: its handshake, then done at once
            time.sleep(self.open_s)
            self.opens += 1
            if self.opens <= self.refused_opens:
                return 0
            self.polls[_OPENED] = 0
            return _OPENED
        time.sleep(self.submit_s)
        self.submits += 1
        if not self.scripts[self.submits - 1]:
            return self.refused_id
        batch_id = 0x5000 + self.submits  # a plausible pointer
        self.polls[batch_id] = 0
        return batch_id

    def transfer_check_status(self, batch_id: int) -> int:
        if batch_id == _OPENED:
            del self.polls[_OPENED]
            return 1
        assert batch_id in self.polls, f"polled an id never handed out: {batch_id:#x}"
        assert batch_id not in self.finished, f"polled {batch_id:#x} after it finished"
        script = self.scripts[batch_id - 0x5001]
        status = script[min(self.polls[batch_id], len(script) - 1)]
        self.polls[batch_id] += 1
        if status != 0:
            self.finished.add(batch_id)
        return status


class NoMooncake:
    """Stands in for the Mooncake engine where a test proves it is never reached."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"mooncake was called: {name}")


def test_mooncake_engine_satisfies_the_protocol(pair: Pair) -> None:
    assert isinstance(pair.sender, Engine)
    host, port = pair.sender.session.rsplit(":", 1)
    assert host == CFG.local_hostname and int(port) > 0
    assert pair.sender.session != pair.receiver.session


def test_write_lands_byte_for_byte_in_a_slot(pair: Pair) -> None:
    block = pair.out.try_alloc(SLOT_BYTES)
    assert block is not None
    try:
        data = torch.randint(0, 256, (SLOT_BYTES,), dtype=torch.uint8)
        pair.out.view(block)[:SLOT_BYTES] = data
        slot = pair.inbox.slots[0]
        pair.sender.write(pair.receiver.session, pair.out.address(block), slot.address, SLOT_BYTES)
        assert torch.equal(pair.inbox.view_at(slot.address, slot.size), data)
    finally:
        pair.out.free(block)


def test_write_lands_at_an_offset_and_nowhere_else(pair: Pair) -> None:
    target = pair.inbox.try_alloc(4096)
    assert target is not None
    try:
        pair.inbox.view(target).zero_()
        pair.out.buffer[1000:1100] = 0xAB
        pair.sender.write(pair.receiver.session, pair.out.base + 1000, pair.inbox.address(target) + 7, 100)
        landed = pair.inbox.view(target)
        assert landed[7:107].eq(0xAB).all()
        assert landed[:7].eq(0).all() and landed[107:].eq(0).all()
    finally:
        pair.inbox.free(target)


def test_write_lands_in_a_pool_that_lives_in_shared_memory(pair: Pair) -> None:
    """Workers keep their pools in shared memory (transfer/shm.py) and peers on other hosts
    still write there with Mooncake."""
    receiver = MooncakeEngine(CFG)
    shared = MemoryPool(POOL_BYTES, slot_sizes=(SLOT_BYTES,), memory=SharedRegion(POOL_BYTES).tensor)
    receiver.register(shared.base, shared.size)
    try:
        pair.out.buffer[:SLOT_BYTES] = torch.arange(SLOT_BYTES, dtype=torch.int64).remainder(251).to(torch.uint8)
        pair.sender.write(receiver.session, pair.out.base, shared.slots[0].address, SLOT_BYTES)
        assert torch.equal(shared.view_at(shared.slots[0].address, SLOT_BYTES), pair.out.buffer[:SLOT_BYTES])
    finally:
        receiver.close()


def test_zero_length_write_does_nothing(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pair.sender, "_te", NoMooncake())
    pair.sender.write("127.0.0.1:1", 0, 0, 0)


def test_unregistered_local_source_is_refused_before_mooncake(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TCP would send it happily and RDMA would not, so the wrapper refuses it everywhere."""
    stray = torch.ones(4096, dtype=torch.uint8)
    monkeypatch.setattr(pair.sender, "_te", NoMooncake())
    session, remote = pair.receiver.session, pair.inbox.base
    with pytest.raises(TransferError, match="not inside one registered range"):
        pair.sender.write(session, stray.data_ptr(), remote, 4096)
    with pytest.raises(TransferError, match="not inside one registered range"):  # straddles the end
        pair.sender.write(session, pair.out.base + pair.out.size - 10, remote, 20)
    with pytest.raises(TransferError, match="cannot write -1 bytes"):
        pair.sender.write(session, pair.out.base, remote, -1)


def test_overlapping_registration_is_reported(pair: Pair) -> None:
    with pytest.raises(TransferError, match="overlap"):
        pair.receiver.register(pair.inbox.base + 4096, 4096)


def test_write_outside_the_peers_range_raises(pair: Pair, peer: Peer) -> None:
    src = pair.out.base
    with pytest.raises(TransferError, match=peer.session):
        pair.sender.write(peer.session, src, peer.address + peer.size - 10, 100)
    with pytest.raises(TransferError, match="failed twice: peer unreachable or dead, or remote range not registered"):
        pair.sender.write(peer.session, src, 0x1000, 100)  # never registered there


def test_valid_write_after_rejected_ones_succeeds(pair: Pair, peer: Peer) -> None:
    """Each rejection tears down a lane; with all four gone the next write fails at once
    and only the wrapper's one retry (after Mooncake's ~1 s reconnect) gets it through."""
    src, beyond = pair.out.base, peer.address + peer.size - 10
    # Raw calls, so the count of rejections does not depend on the wrapper's retry policy.
    assert [pair.sender._te.transfer_sync_write(peer.session, src, beyond, 100) for _ in range(4)] == [-1] * 4
    pair.sender.write(peer.session, src, peer.address, 100)


def test_dead_peer_raises_promptly(pair: Pair, peer: Peer) -> None:
    pair.sender.write(peer.session, pair.out.base, peer.address, 100)
    peer.process.kill()
    peer.process.wait()
    started = time.monotonic()
    with pytest.raises(TransferError, match=peer.session):
        pair.sender.write(peer.session, pair.out.base, peer.address, 100)
    assert time.monotonic() - started < 3


def test_hung_peer_times_out_at_our_deadline_without_burning_cpu(
    pair: Pair, peer: Peer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopped peer never acks; Mooncake would report that only after 30 s. We give up at
    our own deadline, sleeping (not spinning) while we wait."""
    pair.sender.write(peer.session, pair.out.base, peer.address, 100)  # connected and warm
    stop(peer.process)
    monkeypatch.setattr(pair.sender, "write_timeout_s", 0.0)
    monkeypatch.setattr(transfer.engine, "_GRACE_S", 0.5)
    started, cpu = time.monotonic(), time.thread_time()
    with pytest.raises(TransferInDoubt, match=rf"write of 100 bytes .* to {peer.session} .*timed out"):
        pair.sender.write(peer.session, pair.out.base, peer.address, 100)
    elapsed, cpu = time.monotonic() - started, time.thread_time() - cpu
    assert 0.5 <= elapsed < 2
    assert cpu < 0.2 * elapsed, f"polling used {cpu:.3f} s of CPU in {elapsed:.3f} s"


def test_poll_stops_at_done_and_never_repolls(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = ScriptedMooncake([0, 0, 0, 1])
    monkeypatch.setattr(pair.sender, "_te", fake)
    pair.sender.write("peer:1", pair.out.base, 0x1000, 64)
    assert fake.submits == 1 and list(fake.polls.values()) == [4]


def test_failed_attempt_is_retried_once(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = ScriptedMooncake([0, -1], [0, 1])  # the spurious -1 after a rejected write
    monkeypatch.setattr(pair.sender, "_te", fake)
    pair.sender.write("peer:1", pair.out.base, 0x1000, 64)
    assert fake.submits == 2 and list(fake.polls.values()) == [2, 2]

    fake = ScriptedMooncake([], [1])  # submit refused (0): never polled, then retried
    monkeypatch.setattr(pair.sender, "_te", fake)
    pair.sender.write("peer:1", pair.out.base, 0x1000, 64)
    assert fake.submits == 2 and list(fake.polls.values()) == [1]


def test_two_failures_raise(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = ScriptedMooncake([-1], [])
    monkeypatch.setattr(pair.sender, "_te", fake)
    with pytest.raises(TransferError, match="write of 64 bytes .* to peer:1 .*failed twice") as failed:
        pair.sender.write("peer:1", pair.out.base, 0x1000, 64)
    assert not isinstance(failed.value, TransferInDoubt)  # a failed write wrote nothing more
    assert fake.submits == 2 and list(fake.polls.values()) == [1]


def test_a_failure_after_a_stuck_write_is_in_doubt_and_not_retried(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mooncake turns a write stuck on a stalled peer into -1 at its own timeout, and the
    bytes may still land when the peer resumes: that failure is no clean one."""
    fake = ScriptedMooncake([0] * 200 + [-1], [1])
    monkeypatch.setattr(pair.sender, "_te", fake)
    monkeypatch.setattr(transfer.engine, "_STUCK_S", 0.02)
    with pytest.raises(TransferInDoubt, match="write of 64 bytes .* to peer:1 .*failed only after .* stuck"):
        pair.sender.write("peer:1", pair.out.base, 0x1000, 64)
    assert fake.submits == 1


def test_a_submit_that_failed_only_after_hanging_is_not_tried_again(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first write to a peer that takes connections but never answers (stopped, frozen)
    hangs in its handshake for about a minute, then fails: a second try would hang as long,
    holding the worker's push path twice over."""
    fake = ScriptedMooncake([], [1], submit_s=0.05)
    monkeypatch.setattr(pair.sender, "_te", fake)
    monkeypatch.setattr(transfer.engine, "_STUCK_S", 0.02)
    with pytest.raises(TransferError, match=r"write of 64 bytes to peer:1: the submit failed after 0\.\d s") as failed:
        pair.sender.write("peer:1", pair.out.base, 0x1000, 64)
    assert not isinstance(failed.value, TransferInDoubt)  # nothing was submitted
    assert fake.submits == 1


def test_a_write_whose_deadline_passed_in_its_handshake_never_starts(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that takes connections but answers late (its handshake port held by idle
    connections: 5 s each) let a write through a minute on, into memory the daemon may have
    given to another request by then. Nothing is written: a clean failure, not in doubt."""
    fake = ScriptedMooncake([1], open_s=0.1)
    monkeypatch.setattr(pair.sender, "_te", fake)
    monkeypatch.setattr(pair.sender, "_opened", set())  # the shared sender has met peer:1 before
    monkeypatch.setattr(pair.sender, "write_timeout_s", 0.0)
    monkeypatch.setattr(transfer.engine, "_GRACE_S", 0.05)
    with pytest.raises(TransferError, match=r"write of 64 bytes to peer:1: the handshake with it took 0\.1 s, past the "
                                            r"write's 0\.1 s: not started") as failed:
        pair.sender.write("peer:1", pair.out.base, 0x1000, 64)
    assert not isinstance(failed.value, TransferInDoubt)
    assert fake.submits == 0


def test_a_retry_is_not_submitted_past_the_writes_deadline(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The retry of a quick failure keeps the write's own deadline: one submitted later (the
    worker stood still between the attempts) could land after the daemon, hearing nothing,
    handed its target to another request. Nothing more is submitted: a clean failure."""
    fake = ScriptedMooncake([-1], [1], submit_s=0.1)
    monkeypatch.setattr(pair.sender, "_te", fake)
    monkeypatch.setattr(pair.sender, "write_timeout_s", 0.0)
    monkeypatch.setattr(transfer.engine, "_GRACE_S", 0.05)
    with pytest.raises(TransferError, match="write of 64 bytes to peer:1: its deadline passed before it was "
                                            "submitted") as failed:
        pair.sender.write("peer:1", pair.out.base, 0x1000, 64)
    assert not isinstance(failed.value, TransferInDoubt)
    assert fake.submits == 1


def test_a_peer_is_shaken_hands_with_once(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = ScriptedMooncake([1], [1], [1])
    monkeypatch.setattr(pair.sender, "_te", fake)
    monkeypatch.setattr(pair.sender, "_opened", set())
    for _ in range(3):
        pair.sender.write("peer:1", pair.out.base, 0x1000, 64)
    assert (fake.opens, fake.submits) == (1, 3)


def test_a_peer_whose_handshake_failed_is_shaken_hands_with_again(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed handshake opened nothing: the next write must shake hands first again, or
    its submit holds the handshake (up to a minute with a peer that does not answer) past
    the write's deadline."""
    fake = ScriptedMooncake([1], [1], [1], refused_opens=1)
    monkeypatch.setattr(pair.sender, "_te", fake)
    monkeypatch.setattr(pair.sender, "_opened", set())
    pair.sender.write("peer:1", pair.out.base, 0x1000, 64)  # left to the real write, which went through
    assert (fake.opens, fake.submits) == (1, 1)
    for _ in range(2):
        pair.sender.write("peer:1", pair.out.base, 0x1000, 64)
    assert (fake.opens, fake.submits) == (2, 3)


@pytest.mark.parametrize("refused_id", [2**64 - 1, -1], ids=["uint64 -1", "-1"])
def test_a_submit_that_returns_no_real_id_fails_without_a_poll(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, refused_id: int
) -> None:
    """A failed submit returns an error code, not a batch id: polling it would hand Mooncake
    a pointer to nothing (a segfault). Each attempt fails at once, as a refused submit (0) does."""
    fake = ScriptedMooncake([], [], refused_id=refused_id)  # the fake fails the test on a poll of either
    monkeypatch.setattr(pair.sender, "_te", fake)
    monkeypatch.setattr(pair.sender, "_opened", {"peer:1"})
    started = time.monotonic()
    with pytest.raises(TransferError, match="write of 64 bytes .* to peer:1 .*failed twice") as failed:
        pair.sender.write("peer:1", pair.out.base, 0x1000, 64)
    assert not isinstance(failed.value, TransferInDoubt)  # nothing was submitted
    assert time.monotonic() - started < 0.5
    assert fake.submits == 2 and fake.polls == {}


def test_mooncake_timeout_status_raises_without_retry(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = ScriptedMooncake([0, -2], [1])
    monkeypatch.setattr(pair.sender, "_te", fake)
    with pytest.raises(TransferInDoubt, match="write of 64 bytes .* to peer:1 .*Mooncake reported a timeout"):
        pair.sender.write("peer:1", pair.out.base, 0x1000, 64)
    assert fake.submits == 1 and list(fake.polls.values()) == [2]


def test_deadline_raises_without_retry(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = ScriptedMooncake([0], [1])  # the first write never finishes
    monkeypatch.setattr(pair.sender, "_te", fake)
    monkeypatch.setattr(pair.sender, "write_timeout_s", 0.0)
    monkeypatch.setattr(transfer.engine, "_GRACE_S", 0.05)
    started = time.monotonic()
    with pytest.raises(TransferInDoubt, match="write of 4096 bytes .* to peer:1 .*not done after"):
        pair.sender.write("peer:1", pair.out.base, 0x1000, 4096)
    assert 0.05 <= time.monotonic() - started < 0.5
    assert fake.submits == 1
    polls = fake.polls[0x5001]
    assert 3 <= polls < 100, f"{polls} polls in 50 ms: the backoff does not sleep"


def test_deadline_follows_mc_transfer_timeout(pair: Pair) -> None:
    assert pair.sender.write_timeout_s == float(CFG.env["MC_TRANSFER_TIMEOUT"])
    assert transfer_timeout_s(None) == 30.0  # Mooncake's default
    assert transfer_timeout_s("soon") == 30.0
    assert transfer_timeout_s("2.5") == 2.5
    # From the shell (the config refuses these): Mooncake's default, the safe side; past a
    # day, what a Register carries, a day (it was Mooncake's 30 s: shorter than asked).
    assert transfer_timeout_s("-5") == transfer_timeout_s("nan") == transfer_timeout_s("inf") == 30.0
    assert transfer_timeout_s("1e9") == 86400


def test_unknown_session_raises(pair: Pair) -> None:
    with pytest.raises(TransferError, match="127.0.0.1:1 "):
        pair.sender.write("127.0.0.1:1", pair.out.base, 0x1000, 100)


def test_initialize_failure_names_the_settings() -> None:
    cfg = TransferConfig(local_hostname="127.0.0.1:17555", metadata_server="http://127.0.0.1:1/metadata")
    with pytest.raises(TransferError, match="metadata_server='http://127.0.0.1:1/metadata'"):
        MooncakeEngine(cfg)


def test_config_env_overrides_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "99")
    cfg = TransferConfig(metadata_server="http://127.0.0.1:1/metadata")  # fails fast after export
    with pytest.raises(TransferError):
        MooncakeEngine(cfg)
    assert os.environ["MC_TRANSFER_TIMEOUT"] == CFG.env["MC_TRANSFER_TIMEOUT"]


def test_close_unregisters_and_refuses_further_use() -> None:
    engine = MooncakeEngine(CFG)
    pool = MemoryPool(1 << 16)
    engine.register(pool.base, pool.size)
    te = engine._te
    engine.close()
    assert te.unregister_memory(pool.base) == -3  # already unregistered by close()
    engine.close()  # idempotent
    with pytest.raises(TransferError, match="closed"):
        engine.write(engine.session, pool.base, pool.base, 1)
    with pytest.raises(TransferError, match="closed"):
        engine.register(pool.base, pool.size)
