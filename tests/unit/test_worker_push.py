"""How a worker reports a push that failed: a write that ended in failure wrote nothing
more; one it stopped waiting for may still land, and the daemon must know which."""

from __future__ import annotations

import os
import threading
import time

import anyio
import msgspec
import pytest
import torch

from orchestrator.config import Config
from orchestrator.stall_watch import StallWatch
from orchestrator.worker import WorkerRuntime
from orchestrator.worker_memory import INLINE_COPY_BYTES, RequestMemory
from transfer import frames
from transfer.engine import TransferError, TransferInDoubt
from transfer.pool import MemoryPool
from transfer.protocol import WORKER_MESSAGE, LocalMemory, Push, Pushed, Staged, TensorSpec
from transfer.shm import LocalWriter, SharedRegion, host_id


class FailingEngine:
    """The part of ``Engine`` a push uses, failing the way it was told to."""

    def __init__(self, error: TransferError) -> None:
        self.error = error

    def write(self, session: str, local_addr: int, remote_addr: int, nbytes: int) -> None:
        raise self.error


@pytest.mark.parametrize(("error", "in_doubt"), [
    (TransferInDoubt("write of 512 bytes timed out"), True),
    (TransferError("write of 512 bytes failed twice"), False),
])
async def test_a_timed_out_push_is_reported_in_doubt_and_a_failed_one_is_not(
    error: TransferError, in_doubt: bool
) -> None:
    worker = WorkerRuntime("encoder", Config(), name="push-test", engine=FailingEngine(error))  # type: ignore[arg-type]
    worker._use_pool(pool := MemoryPool(1 << 16))
    assert worker._memory is not None
    worker._memory._staged["r1"] = pool.try_alloc(512)
    await worker._memory.push(Push(request_id="r1", session="peer:1", address=0x1000, nbytes=512), time.monotonic())
    (message,) = await worker._outbox.take()
    pushed = WORKER_MESSAGE.decode(message[0])
    assert isinstance(pushed, Pushed) and not pushed.ok and pushed.error == str(error)
    assert pushed.in_doubt == in_doubt
    assert pool.allocated_blocks == 0 and not worker._memory.holds_output("r1")  # the block is freed either way


class RecordingEngine:
    """The part of ``Engine`` a push uses, writing nothing and remembering each call."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, int, int]] = []

    def write(self, session: str, local_addr: int, remote_addr: int, nbytes: int) -> None:
        self.writes.append((session, remote_addr, nbytes))


async def test_a_same_host_copy_that_fails_falls_back_to_the_engine(logs: list[dict]) -> None:
    """The receiver's shared pool cannot be opened (it exited, or lives in another pid
    namespace): the bytes still go, by Mooncake, and the Pushed says so."""
    engine = RecordingEngine()
    worker = WorkerRuntime("encoder", Config(), name="push-test", engine=engine)  # type: ignore[arg-type]
    worker._use_pool(pool := MemoryPool(1 << 16), writers=(LocalWriter(), LocalWriter()))
    assert worker._memory is not None
    worker._memory._staged["r1"] = pool.try_alloc(512)
    gone = LocalMemory(host=host_id(), path="/proc/self/fd/999999", device=1, inode=1, base=0x1000, size=4096)
    await worker._memory.push(Push(request_id="r1", session="peer:1", address=0x1000, nbytes=512, local=gone),
                              time.monotonic())
    (message,) = await worker._outbox.take()
    pushed = WORKER_MESSAGE.decode(message[0])
    assert isinstance(pushed, Pushed) and pushed.ok and pushed.via == "mooncake"
    assert engine.writes == [("peer:1", 0x1000, 512)]
    [failed] = [line for line in logs if line["event"] == "worker.local_copy_failed"]
    assert "cannot open the receiver's pool at /proc/self/fd/999999" in failed["error"]


async def test_the_pool_of_a_same_host_receiver_that_left_is_unmapped_without_another_to_map() -> None:
    """A receiver scaled away, or dead and not restarted: its senders' mappings alone kept its
    whole pool resident until they mapped some other receiver, which may never come."""
    writers = (LocalWriter(), LocalWriter())
    worker = WorkerRuntime("encoder", Config(), name="push-test", engine=RecordingEngine())  # type: ignore[arg-type]
    worker._use_pool(pool := MemoryPool(4 << 20), writers=writers)
    assert worker._memory is not None
    gone, staying = SharedRegion(4 << 20), SharedRegion(4 << 20)
    for rid, region, nbytes in (("small", gone, 512), ("large", gone, INLINE_COPY_BYTES + 4096),
                                ("kept", staying, 512), ("kept-large", staying, INLINE_COPY_BYTES + 4096)):
        worker._memory._staged[rid] = pool.try_alloc(nbytes)
        base = region.tensor.data_ptr()
        await worker._memory.push(Push(request_id=rid, session="peer:1", address=base, nbytes=nbytes,
                                       local=region.describe(base, 4 << 20)), time.monotonic())
    assert all(len(writer._mapped) == 2 for writer in writers)  # each side mapped both receivers
    os.close(gone._fd)  # as if its process exited: the path no longer names its file
    with anyio.move_on_after(0.3):
        await worker._memory.unmap_gone_receivers(period_s=0.01)
    kept = staying.describe(0, 0).path
    assert all([path for path, _, _ in writer._mapped] == [kept] for writer in writers)


@pytest.mark.parametrize("nbytes", [1024, 2 * INLINE_COPY_BYTES])
async def test_a_large_output_is_staged_off_the_loop_and_a_small_one_on_it(nbytes: int,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of many MiB on the loop would hold up the allocs and pushes it answers."""
    copied_on: list[threading.Thread] = []
    pack = frames.pack

    def recorded(*args: object) -> list[TensorSpec]:
        copied_on.append(threading.current_thread())
        return pack(*args)

    monkeypatch.setattr(frames, "pack", recorded)
    worker = WorkerRuntime("encoder", Config(), name="stage-test", engine=object())  # type: ignore[arg-type]
    worker._use_pool(pool := MemoryPool(4 * INLINE_COPY_BYTES))
    assert worker._memory is not None
    output = {"embeds": torch.arange(nbytes // 4, dtype=torch.float32)}
    await worker._memory.stage_output("r1", output, compute_ms=1.0)
    assert (copied_on == [threading.main_thread()]) == (nbytes <= INLINE_COPY_BYTES)
    (message,) = worker._outbox.take_now()
    staged = WORKER_MESSAGE.decode(message[0])
    assert isinstance(staged, Staged) and all(spec.xxh3 is not None for spec in staged.manifest)
    taken = frames.unpack(pool.view(worker._memory._staged["r1"]), staged.manifest)  # its digest checked
    assert torch.equal(taken["embeds"], output["embeds"])


async def test_a_request_aborted_while_its_output_is_copied_stages_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    pack = frames.pack
    monkeypatch.setattr(frames, "pack", lambda *args: time.sleep(0.2) or pack(*args))
    worker = WorkerRuntime("encoder", Config(), name="stage-test", engine=object())  # type: ignore[arg-type]
    worker._use_pool(pool := MemoryPool(4 * INLINE_COPY_BYTES))
    assert worker._memory is not None
    output = {"embeds": torch.zeros(2 * INLINE_COPY_BYTES // 4)}
    with anyio.move_on_after(0.05):
        await worker._memory.stage_output("r1", output, compute_ms=1.0)
    assert pool.allocated_blocks == 0 and not worker._memory.holds_output("r1") and len(worker._outbox) == 0


class Clock:
    """A monotonic clock the test moves: a stall is a jump."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class StallingEngine(RecordingEngine):
    """Its first write takes a while, and the worker stands still (the clock jumps) meanwhile."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def write(self, session: str, local_addr: int, remote_addr: int, nbytes: int) -> None:
        if not self.writes:
            time.sleep(0.1)
            self.clock.now += 5.0
        super().write(session, local_addr, remote_addr, nbytes)


def watched_worker(engine: RecordingEngine, clock: Clock) -> tuple[WorkerRuntime, MemoryPool, RequestMemory]:
    """An encoder's runtime whose loop's stalls are told by ``clock`` (half a heartbeat: 0.5 s)."""
    worker = WorkerRuntime("encoder", Config(), name="push-test", engine=engine)  # type: ignore[arg-type]
    worker._use_pool(pool := MemoryPool(1 << 16))
    assert worker._memory is not None
    worker._memory.stalls = StallWatch(0.5, clock=clock)
    return worker, pool, worker._memory


@pytest.mark.parametrize("late", ["read just before the stall", "waiting for the push thread through it"])
async def test_a_push_read_around_a_stall_of_the_worker_writes_nothing(late: str, logs: list[dict]) -> None:
    """A worker that stood still (SIGSTOP, a frozen container) past two heartbeats was evicted and
    its pushes' targets handed out again, maybe to another request's data: a Push it read
    before (or that waited, unread, through) the stall must not land there. It reports that
    it stood still, nothing written, and keeps its output for the Push the daemon sends
    again (``after_stall``) if that memory is still the request's: that one writes."""
    clock = Clock()
    engine = StallingEngine(clock)
    worker, pool, memory = watched_worker(engine, clock)
    memory._staged["r1"] = pool.try_alloc(512)
    push = Push(request_id="r1", session="peer:1", address=0x1000, nbytes=512)
    if late == "read just before the stall":
        engine.writes.append(("earlier", 0, 0))  # no stall inside the engine: the clock jumps here
        read_at = memory.stalls.look()
        clock.now += 5.0
        await memory.push(push, read_at)
    else:
        memory._staged["first"] = pool.try_alloc(512)
        async with anyio.create_task_group() as tg:
            tg.start_soon(memory.push, Push(request_id="first", session="peer:1", address=0x2000, nbytes=512),
                          memory.stalls.look())
            await anyio.sleep(0.02)  # the first write holds the push thread
            await memory.push(push, memory.stalls.look())
    reports = [WORKER_MESSAGE.decode(body) for message in await worker._outbox.take() for body in message]
    [pushed] = [r for r in reports if isinstance(r, Pushed) and r.request_id == "r1"]
    assert not pushed.ok and pushed.stood_still and not pushed.in_doubt and "stood still for 5.0s" in pushed.error
    assert ("peer:1", 0x1000, 512) not in engine.writes
    assert pool.allocated_blocks == 1 and memory.holds_output("r1")
    assert [line["request_id"] for line in logs if line["event"] == "worker.stale_push_refused"] == ["r1"]
    clock.now += 0.1  # the daemon's answer comes at once, well within the stall's window
    await memory.push(msgspec.structs.replace(push, after_stall=True), memory.stalls.look())
    assert ("peer:1", 0x1000, 512) in engine.writes
    assert pool.allocated_blocks == 0 and not memory.holds_output("r1")


async def test_a_push_sent_again_after_a_stall_is_stale_after_another_stall() -> None:
    clock = Clock()
    engine = RecordingEngine()
    _, pool, memory = watched_worker(engine, clock)
    memory._staged["r1"] = pool.try_alloc(512)
    push = Push(request_id="r1", session="peer:1", address=0x1000, nbytes=512)
    clock.now += 5.0
    await memory.push(push, memory.stalls.look())  # refused: read just as the stall ended
    again = msgspec.structs.replace(push, after_stall=True)
    read_at = memory.stalls.look()
    clock.now += 5.0  # stopped again before it wrote
    await memory.push(again, read_at)
    assert engine.writes == [] and memory.holds_output("r1")
    memory.free("r1")  # the daemon's Abort, the request having ended meanwhile
    assert pool.allocated_blocks == 0 and not memory._refused_after


async def test_a_push_read_well_after_a_stall_writes() -> None:
    clock = Clock()
    engine = RecordingEngine()
    _, pool, memory = watched_worker(engine, clock)
    clock.now += 5.0
    memory.stalls.look()  # the stall, noticed
    for _ in range(3):  # then running, looked at every half limit, for longer than the limit
        clock.now += 0.25
        memory.stalls.look()
    memory._staged["r1"] = pool.try_alloc(512)
    await memory.push(Push(request_id="r1", session="peer:1", address=0x1000, nbytes=512), memory.stalls.look())
    assert engine.writes == [("peer:1", 0x1000, 512)]
