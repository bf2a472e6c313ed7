"""A worker's answers to orders that are odd (repeated, aborted at once, pointing at memory
that is not the request's): nothing crashes, nothing leaks, nothing reads another
request's memory. The runtime is driven without a daemon: orders in (as its work socket's
reader hands them on, or through that reader), reports out."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

from orchestrator.config import Config, ModelConfig, NullStageConfig, WorkerConfig, WorkersConfig
from orchestrator.stages import build_stage
from orchestrator.worker import WorkerRuntime
from tests.loop_watch import LoopWatch
from transfer import frames
from transfer.engine import TransferInDoubt
from transfer.pool import MemoryPool
from transfer.protocol import (
    DAEMON_STOPPING,
    WORKER_MESSAGE,
    Abort,
    Alloc,
    Allocated,
    AllocRejected,
    Done,
    GenParams,
    Push,
    Pushed,
    Ready,
    Reason,
    RegisterRefused,
    Staged,
    Step,
    Stopped,
    TensorSpec,
    Work,
    encode,
)

PARAMS = GenParams(prompt="p", width=8, height=8, steps=1, output="raw")
SLOT = 1024
CFG = Config(model=ModelConfig(kind="null"))


class SlowEngine:
    """Writes nothing, slowly (or until ``gate`` is set), or times out: what a push waits on."""

    def __init__(self, seconds: float = 0.0, error: Exception | None = None,
                 gate: threading.Event | None = None) -> None:
        self.seconds, self.error, self.gate, self.writes = seconds, error, gate, 0

    def write(self, session: str, local_addr: int, remote_addr: int, nbytes: int) -> None:
        self.writes += 1
        time.sleep(self.seconds)
        if self.gate is not None:
            assert self.gate.wait(10), "the test never let the write end"
        if self.error is not None:
            raise self.error


@asynccontextmanager
async def worker(role: str = "denoiser", engine: SlowEngine | None = None, cfg: Config = CFG) -> AsyncIterator[Any]:
    """A runtime with a pool (two 1 KiB slots, as a receiver registers them) and a null
    stage, and a task group its orders run in."""
    w = WorkerRuntime(role, cfg, name="orders-test", engine=engine or SlowEngine())  # type: ignore[arg-type]
    w._use_pool(MemoryPool(1 << 16, slot_sizes=[SLOT, SLOT] if role != "encoder" else []))
    w._runner.stage = build_stage(role, cfg.model, torch_threads=1)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        w.tg = tg
        w.send = lambda *orders: w._on_orders([w._key, *map(encode, orders)], tg)
        yield w


async def reports(w: WorkerRuntime, expect: int, *, settle_s: float = 0.05, within_s: float = 5.0) -> list[Any]:
    """The worker's reports, a decoder's outputs among them: at least ``expect`` of them
    (waiting up to ``within_s``: a run on a loaded machine takes what it takes), then
    whatever more comes within ``settle_s``."""
    out: list[Any] = []

    async def collect(until: float) -> None:
        while len(out) < until:
            messages = w._outbox.take_now() + w._outputs.take_now()
            if not messages:
                await anyio.sleep(0.005)
            for message in messages:
                out.extend(WORKER_MESSAGE.decode(body) for body in message if isinstance(body, bytes))

    with anyio.fail_after(within_s):
        await collect(expect)
    with anyio.move_on_after(settle_s):
        await collect(float("inf"))
    return out


@pytest.mark.parametrize("together", [False, True], ids=["later", "in the same message"])
async def test_a_repeated_push_is_ignored_and_the_first_reports_once(together: bool) -> None:
    """Before, the repeat wrote from the block the first one freed, then killed the worker."""
    engine = SlowEngine(seconds=0.2)
    async with worker("encoder", engine) as w:
        w._memory._staged["r1"] = w._pool.try_alloc(512)
        push = Push(request_id="r1", session="peer:1", address=0x1000, nbytes=512)
        if together:
            w.send(push, push)
        else:
            w.send(push)
            await anyio.sleep(0.05)
            w.send(push)
        done = await reports(w, 1, settle_s=0.5)
    assert [type(r) for r in done] == [Pushed] and done[0].ok
    assert engine.writes == 1 and w._pool.allocated_blocks == 0


async def test_a_repeated_alloc_or_work_is_ignored_and_an_abort_frees_everything() -> None:
    async with worker() as w:
        w.send(Alloc(request_id="r1", nbytes=256))
        await anyio.sleep(0.05)
        w.send(Alloc(request_id="r1", nbytes=256))
        assert [type(r) for r in await reports(w, 1)] == [Allocated]
        w.send(Abort(request_id="r1"))
        await reports(w, 0)
        assert w._pool.allocated_blocks == 0
    async with worker("encoder") as w:
        w.send(Work(request_id="r2", params=PARAMS), Work(request_id="r2", params=PARAMS))
        staged = await reports(w, 1)
        assert [type(r) for r in staged] == [Staged]
        w.send(Abort(request_id="r2"))
        await reports(w, 0)
        assert w._pool.allocated_blocks == 0


async def test_an_abort_right_behind_an_order_stops_it_before_it_holds_anything() -> None:
    """An allocation that fits at once never yields: the Abort must still win."""
    async with worker() as w:
        w.send(Alloc(request_id="r1", nbytes=256), Abort(request_id="r1"))
        assert await reports(w, 0) == []
        assert w._pool.allocated_blocks == 0


async def waiting_for_memory(w: WorkerRuntime) -> None:
    with anyio.fail_after(5):
        while not w._pool.waiters:
            await anyio.sleep(0.01)


@pytest.mark.parametrize("role", ["encoder", "denoiser"])
async def test_a_request_aborted_just_after_its_memory_was_granted_holds_none_of_it(role: str) -> None:
    """One message aborts the request holding the whole pool, then one waiting for room (an
    allocation for a push, or a stage's output to stage): the first abort's free grants the
    waiter its memory, and the second abort must still take it back, with no report."""
    async with worker(role) as w:
        w.send(Alloc(request_id="hog", nbytes=w._pool.capacity))
        assert [type(r) for r in await reports(w, 1)] == [Allocated]
        waiter = Alloc(request_id="r1", nbytes=256) if role == "denoiser" else Work(request_id="r1", params=PARAMS)
        w.send(waiter)
        await waiting_for_memory(w)
        w.send(Abort(request_id="hog"), Abort(request_id="r1"))
        assert await reports(w, 0, settle_s=0.2) == []
        assert w._pool.allocated_blocks == 0


def with_alloc_timeout(seconds: float) -> Config:
    denoiser = msgspec.structs.replace(CFG.workers.denoiser, alloc_timeout_s=seconds)
    return msgspec.structs.replace(CFG, workers=msgspec.structs.replace(CFG.workers, denoiser=denoiser))


async def answer_to(w: WorkerRuntime, order: Alloc, *, within_s: float) -> tuple[list[Any], float]:
    """What the worker reports to ``order`` within ``within_s`` (nothing, if it stays silent),
    and how long the first report took."""
    started = time.perf_counter()
    w.send(order)
    try:
        out = await reports(w, 1, settle_s=0.0, within_s=within_s)
    except TimeoutError:
        out = []
    return out, time.perf_counter() - started


async def test_an_alloc_that_does_not_fit_in_time_is_rejected_and_frees_nothing_it_did_not_take() -> None:
    """Reference defect 8: a receiver whose pool stays full must answer AllocRejected once
    alloc_timeout_s has passed; silent, the daemon would wait for it until the request's
    deadline (it has no timer of its own on an allocation). The rejection gives back only
    what the rejected request held (nothing): the memory another request holds stays its."""
    timeout_s = 0.05
    async with worker(cfg=with_alloc_timeout(timeout_s)) as w:
        w.send(Alloc(request_id="hog", nbytes=w._pool.capacity - 512))
        assert [type(r) for r in await reports(w, 1)] == [Allocated]
        free = w._pool.free_bytes
        assert free == 512
        out, took_s = await answer_to(w, Alloc(request_id="r1", nbytes=1024), within_s=timeout_s + 1.0)
        assert [type(r) for r in out] == [AllocRejected], "a receiver without room must answer, not stay silent"
        [rejected] = out
        assert rejected.request_id == "r1"
        assert f"no room for 1024 bytes within {timeout_s}s" in rejected.message
        assert took_s >= timeout_s  # it waited for room first
        assert w._pool.free_bytes == free and w._pool.allocated_blocks == 1 and w._pool.waiters == 0
        assert w._memory.holds_input("hog") and not w._memory.holds_input("r1")
        # Nothing queued behind it: an Alloc that fits is granted at once, and the hog's memory is still its own.
        w.send(Alloc(request_id="r2", nbytes=256))
        assert [type(r) for r in await reports(w, 1)] == [Allocated]
        w.send(Abort(request_id="hog"), Abort(request_id="r2"))
        await reports(w, 0)
        assert w._pool.free_bytes == w._pool.capacity and w._pool.allocated_blocks == 0
        w.tg.cancel_scope.cancel()


async def test_an_alloc_larger_than_the_whole_pool_region_is_rejected_at_once() -> None:
    """Waiting cannot help: the answer comes now, not after alloc_timeout_s (10 s here)."""
    async with worker() as w:
        assert w._wcfg.alloc_timeout_s >= 10
        free = w._pool.free_bytes
        nbytes = w._pool.capacity + 1
        # Within 2 s, far short of the 10 s a wait for room would take.
        out, _ = await answer_to(w, Alloc(request_id="r1", nbytes=nbytes), within_s=2.0)
        assert [type(r) for r in out] == [AllocRejected], "a receiver that can never fit it must say so"
        [rejected] = out
        assert rejected.request_id == "r1"
        assert f"{nbytes} bytes can never fit" in rejected.message
        assert w._pool.free_bytes == free == w._pool.capacity
        assert w._pool.allocated_blocks == 0 and w._pool.waiters == 0 and not w._memory.holds_input("r1")
        w.tg.cancel_scope.cancel()


def ready_for(w: WorkerRuntime, manifest: list[TensorSpec], *, slot_id: int | None = 0,
              address: int | None = None) -> Ready:
    slot = w._pool.slots[0]
    return Ready(request_id="r1", params=PARAMS, address=slot.address if address is None else address,
                 manifest=manifest, slot_id=slot_id)


@pytest.mark.parametrize(("case", "why"), [
    ("past its slot", "outside a 1024-byte block"),
    ("another address", "this request's input is at"),
    ("no memory", "names no memory of this request's"),
    ("overlapping", "inside the tensor before it"),
])
async def test_a_ready_that_points_past_its_own_input_fails_and_reads_nothing_else(case: str, why: str) -> None:
    """Slot 1 (another request's input, say) is never read through slot 0's Ready."""
    latents = TensorSpec(name="embeds", dtype="float32", shape=(16,), offset=0, nbytes=64)
    async with worker() as w:
        ready = {
            "past its slot": ready_for(w, [msgspec.structs.replace(latents, shape=(512,), nbytes=2048)]),
            "another address": ready_for(w, [latents], address=w._pool.slots[1].address),
            "no memory": ready_for(w, [latents], slot_id=None),
            "overlapping": ready_for(w, [latents, msgspec.structs.replace(latents, name="again", offset=32)]),
        }[case]
        w.send(ready)
        (done,) = await reports(w, 1)
    assert isinstance(done, Done) and not done.ok and why in done.error


async def test_an_input_written_over_after_it_landed_fails_as_a_hand_off_and_is_freed(logs: list[dict]) -> None:
    """A late write (a sender that woke from a freeze) landed in the slot after this
    request's own: the copy taken fails its digest, and the run fails ``transfer_failed``,
    which the daemon retries, rather than computing on wrong bytes."""
    latents = {"latents": torch.ones(1, 4, 1, 1)}
    async with worker("decoder") as w:
        specs, _ = frames.layout(latents)
        slot = w._pool.view_at(w._pool.slots[0].address, w._pool.slots[0].size)
        specs = frames.pack(slot, latents, specs)
        slot[3] ^= 0x40  # the late write
        w.send(ready_for(w, specs))
        (done,) = await reports(w, 1)
    assert isinstance(done, Done) and not done.ok and done.reason == Reason.TRANSFER_FAILED
    assert "tensor 'latents': its bytes are not those its sender staged" in done.error
    assert [line["request_id"] for line in logs if line["event"] == "worker.input_corrupted"] == ["r1"]
    assert not w._memory.holds_input("r1")


async def test_a_push_in_doubt_keeps_the_worker_from_saying_leaving_until_the_quarantine_ends() -> None:
    """Leaving tells the daemon no write of this worker's is in flight: not so after a
    push it stopped waiting for."""
    async with worker("encoder", SlowEngine(error=TransferInDoubt("timed out"))) as w:
        assert w._may_say_leaving()
        w._memory._staged["r1"] = w._pool.try_alloc(512)
        w.send(Push(request_id="r1", session="peer:1", address=0x1000, nbytes=512))
        (pushed,) = await reports(w, 1)
    assert isinstance(pushed, Pushed) and pushed.in_doubt
    assert not w._may_say_leaving()
    w._memory.in_doubt_until = time.monotonic()
    assert w._may_say_leaving()


def test_unpack_refuses_specs_that_overlap() -> None:
    block = torch.zeros(256, dtype=torch.uint8)
    spec = TensorSpec(name="a", dtype="uint8", shape=(64,), offset=0, nbytes=64)
    with pytest.raises(ValueError, match="inside the tensor before it"):
        frames.unpack(block, [spec, msgspec.structs.replace(spec, name="b", offset=63)])
    assert set(frames.unpack(block, [spec, msgspec.structs.replace(spec, name="b", offset=64)])) == {"a", "b"}


async def test_an_order_nested_too_deep_is_skipped_and_the_rest_are_handled() -> None:
    deep = bytes([0x83]) + encode(Abort(request_id="x"))[1:] + encode("deep") + b"\x91" * 2000 + b"\xc0"
    async with worker() as w:
        w._on_orders([w._key, deep, encode(Alloc(request_id="r1", nbytes=256))], w.tg)
        assert [type(r) for r in await reports(w, 1)] == [Allocated]


@pytest.mark.parametrize("progress", [False, True])
async def test_steps_are_reported_only_when_asked_and_at_most_every_interval(progress: bool) -> None:
    """20 steps of 20 ms with progress_interval_s = 0.1: a handful of Steps, not 20, and none
    at all for a client that did not ask."""
    cfg = Config(model=ModelConfig(kind="null", null=NullStageConfig(embed_shape=(16,), denoiser_ms=400.0)),
                 workers=WorkersConfig(denoiser=WorkerConfig(progress_interval_s=0.1)))
    embeds = TensorSpec(name="embeds", dtype="float32", shape=(16,), offset=0, nbytes=64)
    async with worker(cfg=cfg) as w:
        ready = ready_for(w, [embeds])
        w.send(msgspec.structs.replace(ready, params=msgspec.structs.replace(PARAMS, steps=20), progress=progress))
        got = await reports(w, 1 + 2 * progress, within_s=10)
        while not any(isinstance(r, Staged) for r in got):
            got += await reports(w, 1, within_s=10)
    steps = [r.step for r in got if isinstance(r, Step)]
    if progress:
        assert 2 <= len(steps) <= 6 and steps == sorted(steps), steps
    else:
        assert steps == []


async def test_a_step_that_does_not_move_on_is_not_reported() -> None:
    """A second-order scheduler runs two timesteps a step, each reported as the same step: the
    second spent the interval, and the daemon dropped it as not moving on."""
    cfg = Config(workers=WorkersConfig(denoiser=WorkerConfig(progress_interval_s=1e-9)))
    async with worker(cfg=cfg) as w:
        on_step = w._runner.step_reporter("r1")
        for done in (0, 0, 1, 1, 2):
            on_step(done, 3)
        assert [(r.step, r.steps) for r in await reports(w, 3)] == [(0, 3), (1, 3), (2, 3)]


async def test_a_flood_of_orders_without_the_key_costs_a_few_log_lines(logs: list[dict]) -> None:
    """Anyone who reaches a tcp work socket can send it junk; each is dropped, and the log
    says so a few times, not once per message."""
    async with worker() as w:
        for _ in range(200):
            w._on_orders([b"not the key", encode(Alloc(request_id="r1", nbytes=256))], w.tg)
            w._on_orders([w._key, b"\xc1"], w.tg)
        assert await reports(w, 0) == []
    assert [line["event"] for line in logs].count("worker.order_refused") == 10
    assert [line["event"] for line in logs].count("worker.bad_order") == 10


async def test_compute_time_counts_from_when_a_compute_thread_takes_the_run() -> None:
    """Two runs on the one compute thread: the second waits the first's 300 ms out, and that
    wait is its stage's queueing (the daemon's queued_ms), not its compute."""
    cfg = Config(model=ModelConfig(kind="null", null=NullStageConfig(encoder_ms=300.0)))
    async with worker("encoder", cfg=cfg) as w:
        assert cfg.workers.encoder.compute_threads == 1
        w.send(Work(request_id="r1", params=PARAMS), Work(request_id="r2", params=PARAMS))
        staged = await reports(w, 2)
    assert sorted(r.request_id for r in staged) == ["r1", "r2"]
    assert all(300 <= r.compute_ms < 450 for r in staged), [r.compute_ms for r in staged]


async def test_runs_waiting_for_the_compute_thread_take_it_by_priority() -> None:
    """The worker holds more requests than it computes at once: those waiting go in as the
    daemon's queues would send them, higher priority first, not in the order they came."""
    cfg = Config(model=ModelConfig(kind="null", null=NullStageConfig(encoder_ms=100.0)))
    async with worker("encoder", cfg=cfg) as w:
        w.send(Work(request_id="running", params=PARAMS))
        await anyio.sleep(0.03)
        # (Three staged outputs fill this worker's pool.)
        w.send(Work(request_id="low", params=PARAMS, priority=-1), Work(request_id="high", params=PARAMS, priority=5))
        staged = await reports(w, 3)
    assert [r.request_id for r in staged] == ["running", "high", "low"]


async def test_an_abort_with_an_ack_is_answered_once_the_run_it_stopped_has_ended() -> None:
    """The daemon holds the worker's slot until then: a pass that cannot stop early (the
    null encoder's 300 ms) answers at its end, a run still waiting for the compute thread and
    a request with nothing running here answer at once, and nothing is staged."""
    cfg = Config(model=ModelConfig(kind="null", null=NullStageConfig(encoder_ms=300.0)))
    async with worker("encoder", cfg=cfg) as w:
        w.send(Work(request_id="r1", params=PARAMS), Work(request_id="r2", params=PARAMS))
        await anyio.sleep(0.05)  # r1 has the compute thread, r2 waits for it
        aborted_at = time.monotonic()
        w.send(Abort(request_id="r1", ack=7), Abort(request_id="r2", ack=8), Abort(request_id="r9", ack=9))
        at_once = await reports(w, 2, settle_s=0.0)
        assert sorted(at_once, key=lambda r: r.ack) == [Stopped(request_id="r2", ack=8),
                                                        Stopped(request_id="r9", ack=9)]
        assert await reports(w, 1) == [Stopped(request_id="r1", ack=7)]
        assert time.monotonic() - aborted_at >= 0.2  # not before the pass was over
        assert w._pool.allocated_blocks == 0 and not w._owed


async def test_a_stage_that_fails_after_its_abort_reports_only_the_stopped_the_abort_asked_for() -> None:
    """A decoder's one pass cannot stop early; aborted during it, it then fails: the daemon
    hears only the ack, no Done about a request it ended."""
    cfg = Config(model=ModelConfig(kind="null", null=NullStageConfig(decoder_ms=300.0)))
    wrong = TensorSpec(name="embeds", dtype="float32", shape=(16,), offset=0, nbytes=64)  # no latents: it fails
    async with worker("decoder", cfg=cfg) as w:
        w.send(ready_for(w, [wrong]))
        await anyio.sleep(0.05)
        w.send(Abort(request_id="r1", ack=7))
        assert await reports(w, 1, settle_s=0.5) == [Stopped(request_id="r1", ack=7)]


async def test_an_order_in_the_last_turn_of_a_registration_does_not_outlive_it() -> None:
    """A Work handled in the loop turn that ends the registration never runs (its task is
    cancelled first): under the next registration the same request id is served, not
    refused as a repeat."""
    async with worker("encoder") as w:
        w.send(Work(request_id="r1", params=PARAMS))
        w.tg.cancel_scope.cancel()  # what the end of a registration does
    await w._forget_everything(RegisterRefused(message=DAEMON_STOPPING, rejoin=True, settled=True))
    async with anyio.create_task_group() as tg:  # the next registration's
        w._on_orders([w._key, encode(Work(request_id="r1", params=PARAMS))], tg)
        assert [type(r) for r in await reports(w, 1)] == [Staged]
        tg.cancel_scope.cancel()


async def test_heartbeats_do_not_pile_up_while_the_daemon_takes_nothing() -> None:
    """The daemon is gone: the socket's queue fills and the reports' sender waits. A beat
    is queued only when nothing else waits to leave."""
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.SNDHWM, 10)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect("ipc:///nonexistent-dir/no-daemon")
    try:
        async with worker("encoder") as w:
            w.tg.start_soon(w._heartbeat, 0.001)
            w.tg.start_soon(w._send, w._outbox, dealer)
            await anyio.sleep(0.5)
            assert len(w._outbox) == 1
            w.tg.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)


async def test_a_ready_on_the_slow_path_gives_its_allocation_back_once_its_input_is_read() -> None:
    """No slot was free: the Alloc's block holds the input until the Ready copies it out.
    Nothing else frees that block (the Abort finds it no longer the request's input), so a
    run that kept it would leak it for good."""
    latents = TensorSpec(name="latents", dtype="float32", shape=(1, 4, 1, 1), offset=0, nbytes=16)
    async with worker("decoder") as w:
        w.send(Alloc(request_id="r1", nbytes=latents.nbytes))
        [allocated] = await reports(w, 1)
        assert isinstance(allocated, Allocated) and w._pool.allocated_blocks == 1
        w.send(Ready(request_id="r1", params=PARAMS, address=allocated.address, manifest=[latents], slot_id=None))
        [done] = await reports(w, 1)
        assert isinstance(done, Done) and done.ok
        assert w._pool.allocated_blocks == 0 and not w._memory.holds_input("r1")


async def test_an_abort_during_a_push_frees_its_output_only_when_the_write_ends() -> None:
    """The write is still reading the staged block: freed at once, it could be handed to the
    next output and overwritten under the write. The push still reports (the daemon awaits
    its Pushed), then frees it."""
    engine = SlowEngine(gate=threading.Event())
    async with worker("encoder", engine) as w:
        w._memory._staged["r1"] = w._pool.try_alloc(512)
        w.send(Push(request_id="r1", session="peer:1", address=0x1000, nbytes=512))
        with anyio.fail_after(5):
            while not engine.writes:  # the write is under way
                await anyio.sleep(0.01)
        w.send(Abort(request_id="r1"))
        await anyio.sleep(0.05)
        assert w._pool.allocated_blocks == 1 and w._memory.pushing("r1")
        engine.gate.set()
        [pushed] = await reports(w, 1)
    assert isinstance(pushed, Pushed) and pushed.ok and pushed.request_id == "r1"
    assert w._pool.allocated_blocks == 0 and not w._memory.holds_output("r1")


async def test_a_push_longer_than_its_staged_output_writes_nothing_and_frees_it() -> None:
    """A buggy or forged order: the write would read past the block, whatever the pool holds
    next (another request's output) going to the peer. It fails as a failed write does."""
    engine = SlowEngine()
    async with worker("encoder", engine) as w:
        w._memory._staged["r1"] = block = w._pool.try_alloc(512)
        w.send(Push(request_id="r1", session="peer:1", address=0x1000, nbytes=block.size + 1))
        [pushed] = await reports(w, 1)
    assert isinstance(pushed, Pushed) and not pushed.ok and not pushed.in_doubt
    assert pushed.error == (f"a push of {block.size + 1} bytes is longer than the output staged for 'r1' "
                            f"({block.size} bytes)")
    assert engine.writes == 0
    assert w._pool.allocated_blocks == 0 and not w._memory.holds_output("r1")


async def test_orders_past_the_most_one_message_carries_are_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon sends at most ORDERS_PER_MESSAGE orders a message: more are not its."""
    monkeypatch.setattr("orchestrator.worker.ORDERS_PER_MESSAGE", 2)
    async with worker() as w:
        w.send(*(Alloc(request_id=f"r{i}", nbytes=256) for i in range(3)))
        allocated = await reports(w, 2, settle_s=0.2)
    assert [r.request_id for r in allocated] == ["r0", "r1"]


async def test_a_message_of_a_million_frames_never_holds_the_workers_loop_for_long(tmp_path: Path) -> None:
    """Anyone who reaches a work socket can send, and its size limit is per frame: read
    whole, one message of a million empty frames held the worker's loop, heartbeats and
    pushes with it, for a second. Its rest is dropped a batch at a time, and the orders
    after it are read as ever."""
    loop = LoopWatch()
    ctx = zmq.asyncio.Context()
    work = ctx.socket(zmq.PULL, socket_class=zmq.Socket)  # plain, as the worker's own
    sender = ctx.socket(zmq.PUSH)
    try:
        work.bind(f"ipc://{tmp_path}/work")
        sender.setsockopt(zmq.SNDHWM, 0)
        sender.connect(f"ipc://{tmp_path}/work")
        with anyio.fail_after(20):
            async with worker() as w:
                w.tg.start_soon(w._order_reader(work, w.tg).run)
                w.tg.start_soon(loop.run)
                await sender.send_multipart([b"stranger", *[b""] * 1_000_000])
                await sender.send_multipart([w._key, encode(Alloc(request_id="r1", nbytes=256))])
                allocated = await reports(w, 1)
                w.tg.cancel_scope.cancel()
    finally:
        sender.close(linger=0)
        work.close(linger=0)
        ctx.destroy(linger=0)
    assert [type(r) for r in allocated] == [Allocated]
    assert loop.longest_gap < 0.1
