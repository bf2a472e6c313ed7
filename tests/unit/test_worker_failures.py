"""What a worker lets go of when its stage fails: the request's tensors at once (not at the
garbage collector's leisure), the GPU's cached memory after running out of it, and itself
after a CUDA error that may have left its GPU context unusable."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import pytest
import torch
import zmq
import zmq.asyncio
from structlog.testing import capture_logs

from orchestrator.daemon_link import DaemonLink
from orchestrator.stages import RunControl, StageError, StageStopped
from orchestrator.stages.base import released
from orchestrator.watchdog import EXIT_DEVICE_BROKEN
from tests.unit.test_daemon_link import KEY, outputs_to_a_dead_daemon
from tests.unit.test_worker_orders import CFG, PARAMS, reports, worker
from transfer.protocol import (
    MAX_ERROR_TEXT,
    WORKER_MESSAGE,
    Done,
    Heartbeat,
    Reason,
    Registered,
    Staged,
    Stopped,
    Work,
    encode,
)


class Failing:
    """A stage that holds a tensor in its frame when it raises ``failure``."""

    def __init__(self, failure: BaseException) -> None:
        self.failure = failure
        self.held: weakref.ref[torch.Tensor] | None = None

    def run(self, params, inputs, *, control: RunControl) -> dict[str, torch.Tensor]:
        latents = torch.ones(1 << 16)
        self.held = weakref.ref(latents)
        raise self.failure


@pytest.fixture
def no_collector() -> Iterator[None]:
    """Only reference counts free anything: what waits for a collection is seen to wait."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.usefixtures("no_collector")
@pytest.mark.parametrize("failure", [StageStopped(), StageError("bad prompt"), RuntimeError("a bug"),
                                     torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")],
                         ids=["stopped", "failed", "crashed", "out of GPU memory"])
async def test_a_failed_runs_tensors_are_freed_when_it_ends(failure: BaseException) -> None:
    """Before, the traceback kept the stage's frames, and a cycle through the worker thread's
    future kept the traceback: a stopped request held its GPU memory until a collection."""
    stage = Failing(failure)
    async with worker("encoder") as w:
        w._runner.stage = stage
        w.send(Work(request_id="r1", params=PARAMS))
        done = await reports(w, 0 if isinstance(failure, StageStopped) else 1)
        w.tg.cancel_scope.cancel()
    assert stage.held is not None and stage.held() is None
    assert all(isinstance(r, Done) and not r.ok for r in done)


async def test_running_out_of_gpu_memory_fails_the_request_plainly(logs: list[dict],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    async with worker("encoder") as w:
        w._runner.stage = Failing(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB\nmore lines"))
        w.send(Work(request_id="r1", params=PARAMS))
        [done] = await reports(w, 1)
        w.tg.cancel_scope.cancel()
    assert done == Done(request_id="r1", ok=False, compute_ms=done.compute_ms, reason=Reason.STAGE_FAILED,
                        error="out of GPU memory for this request: CUDA out of memory. Tried to allocate 2 GiB")
    assert emptied == [True]  # the allocator's cache back to the card the other workers share
    assert not [e for e in logs if e["event"] == "worker.stage_crashed"]  # a resource failure, not a bug


def test_an_out_of_memory_error_without_a_message_still_fails_plainly() -> None:
    failure = released(torch.OutOfMemoryError())
    assert isinstance(failure, StageError) and str(failure) == "out of GPU memory for this request"


@pytest.mark.parametrize("failure", [
    torch.AcceleratorError("CUDA error: out of memory\nCompile with TORCH_USE_CUDA_DSA"),  # a kernel's own cudaMalloc
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
], ids=["cudaMalloc", "cuBLAS", "cuDNN"])
def test_running_out_of_gpu_memory_outside_torchs_allocator_is_out_of_memory_too(
    failure: RuntimeError, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel's cudaMalloc failing came as an AcceleratorError, taken for a poisoned context:
    the worker exited (71) and its request was not retried, over a recoverable failure."""
    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    released_as = released(failure)
    assert isinstance(released_as, StageError)
    assert str(released_as) == f"out of GPU memory for this request: {str(failure).splitlines()[0]}"
    assert emptied == [True]


async def test_a_cuda_error_fails_its_request_and_takes_the_worker_down(logs: list[dict]) -> None:
    """Every later kernel of a poisoned context fails at once, and a worker that fails at once
    looks idlest to the dispatch: it exits instead, as a hung stage does. Its request fails
    first: started again elsewhere, a request that faults the device would take down every
    worker it is retried on."""
    exits: list[int] = []
    async with worker("encoder") as w:
        w._exit_at_once = exits.append  # type: ignore[method-assign]
        w._runner.stage = Failing(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
        w.send(Work(request_id="r1", params=PARAMS))
        [done] = await reports(w, 1)
        w.tg.cancel_scope.cancel()
    assert exits == [EXIT_DEVICE_BROKEN]
    assert done.request_id == "r1" and not done.ok and done.reason == Reason.STAGE_FAILED
    assert done.error == "the device failed and its worker exits: CUDA error: an illegal memory access was encountered"
    [event] = [e for e in logs if e["event"] == "worker.device_broken"]
    assert event["request_id"] == "r1" and "illegal memory access" in event["error"]


@pytest.mark.parametrize("writing", [False, True], ids=["idle", "a push under way"])
async def test_a_worker_whose_device_broke_gets_its_reports_out_before_it_exits(writing: bool, tmp_path: Path) -> None:
    """The failed request's Done reaches the daemon (what was queued before it too), and
    then Leaving, so the daemon starts the worker's other requests again at once; but not
    while a push of its own may still be writing into a receiver's memory."""
    endpoint = f"ipc://{tmp_path}/workers"
    daemon_ctx, link = zmq.Context(), DaemonLink(endpoint)
    daemon = daemon_ctx.socket(zmq.ROUTER)
    daemon.bind(endpoint)
    link.connect()
    exits: list[int] = []
    try:
        async with worker("encoder") as w:
            w._exit_at_once = exits.append  # type: ignore[method-assign]
            w._daemon_link = link
            if writing:
                w._memory._pushing.add("r0")
            w._runner.stage = Failing(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
            w._report(Stopped(request_id="r0", ack=1))  # queued before the fault
            w.send(Work(request_id="r1", params=PARAMS))
            with anyio.fail_after(5):
                while not exits:
                    await anyio.sleep(0.01)
            w.tg.cancel_scope.cancel()
        assert exits == [EXIT_DEVICE_BROKEN] and link.ctx.closed  # the linger waited for what was queued
        heard = []
        while daemon.poll(1000):
            heard += [WORKER_MESSAGE.decode(body) for body in daemon.recv_multipart()[1:]]
    finally:
        link.close(0)  # done already, unless the test failed before
        daemon.close(linger=0)
        daemon_ctx.term()
    assert [type(m).__name__ for m in heard] == ["Stopped", "Done", *([] if writing else ["Leaving"])]
    assert heard[1].request_id == "r1" and heard[1].reason == Reason.STAGE_FAILED


class Returning:
    """A stage that returns ``outputs`` whatever it is asked."""

    def __init__(self, outputs: dict[str, torch.Tensor]) -> None:
        self.outputs = outputs

    def run(self, params, inputs, *, control: RunControl) -> dict[str, torch.Tensor]:
        return self.outputs


@pytest.mark.parametrize(("role", "outputs", "why"), [
    ("encoder", {f"t{i}": torch.zeros(1) for i in range(65)},
     "65 output tensors; a hand-off or result carries at most 64"),
    ("encoder", {"x" * 300: torch.zeros(1)}, "is 300 characters, more than 256"),
    ("decoder", {"images": torch.zeros((1,) * 9, dtype=torch.uint8)}, "has 9 dimensions, more than 8"),
], ids=["too many", "long name", "too many dimensions"])
async def test_outputs_the_wire_refuses_fail_their_request_saying_why(role: str, outputs: dict[str, torch.Tensor],
                                                                       why: str) -> None:
    """Reported as they are, the daemon would drop the report unread and the request would
    wait out its deadline. (``reports`` decodes as the daemon does.)"""
    async with worker(role) as w:
        w._runner.stage = Returning(outputs)
        w.send(Work(request_id="r1", params=PARAMS))
        [done] = await reports(w, 1)
        w.tg.cancel_scope.cancel()
    assert isinstance(done, Done) and not done.ok and done.reason == Reason.STAGE_FAILED and why in done.error


async def test_a_failure_with_a_huge_message_reaches_the_daemon_cut_short() -> None:
    """An exception's text can hold a whole tensor's printout; the wire bounds what the
    daemon relays to the client, and a report past it would be dropped unread."""
    async with worker("encoder") as w:
        w._runner.stage = Failing(StageError("bad prompt: " + "x" * 100_000))
        w.send(Work(request_id="r1", params=PARAMS))
        [done] = await reports(w, 1)  # decoded as the daemon does
        w.tg.cancel_scope.cancel()
    assert isinstance(done, Done) and done.error.startswith("bad prompt: xxx") and done.error.endswith("…")
    assert len(done.error) == MAX_ERROR_TEXT


@pytest.mark.parametrize(("over", "sent"), [(0, True), (1, False)], ids=["exactly the limit", "one byte more"])
async def test_a_decoder_output_up_to_the_daemons_frame_limit_is_sent_and_one_past_it_fails(over: int,
                                                                                            sent: bool) -> None:
    """The daemon cuts off, unread, a worker whose frame passes its worker_max_message_bytes
    (sent in Registered), and then takes it for dead: that request fails here instead."""
    limit = 4096
    async with worker("decoder") as w:
        w._runner._max_message_bytes = limit
        w._runner.stage = Returning({"images": torch.zeros(limit + over, dtype=torch.uint8)})
        w.send(Work(request_id="r1", params=PARAMS))
        [done] = await reports(w, 1)
        w.tg.cancel_scope.cancel()
    assert isinstance(done, Done) and done.ok == sent
    if not sent:
        assert done.reason == Reason.INVALID
        assert f"is {limit + 1} bytes" in done.error and f"worker_max_message_bytes = {limit}" in done.error


async def test_no_room_to_stage_an_output_in_time_is_a_failed_hand_off_which_is_retried() -> None:
    """Its pool full of outputs no receiver has taken yet (slow receivers): like a receiver
    without room, a failed hand-off, started again on the workers left; stage_failed would
    tell the client its request was bad, and end it."""
    encoder = msgspec.structs.replace(CFG.workers.encoder, alloc_timeout_s=0.2)
    cfg = msgspec.structs.replace(CFG, workers=msgspec.structs.replace(CFG.workers, encoder=encoder))
    async with worker("encoder", cfg=cfg) as w:
        for rid in ("r1", "r2", "r3", "r4"):  # 19,712 bytes each, into 64 KiB: three fit
            w.send(Work(request_id=rid, params=PARAMS))
        done = await reports(w, 4, settle_s=0.3)
        w.tg.cancel_scope.cancel()
    staged = [r.request_id for r in done if isinstance(r, Staged)]
    [failed] = [r for r in done if isinstance(r, Done)]
    assert len(staged) == 3 and failed.request_id not in staged
    assert (failed.ok, failed.reason) == (False, Reason.TRANSFER_FAILED)
    assert failed.error.startswith("no room to stage its output: ")


@pytest.mark.parametrize("held", [0, 1], ids=["nothing held", "an output held"])
async def test_a_decoder_stopping_after_its_daemon_died_warns_only_of_outputs_it_held(
    held: int, tmp_path: Path, logs: list[dict]
) -> None:
    """Its Leaving can get no answer. With nothing to hand over nothing was lost: a warning
    that outputs were sent operators looking for work that never existed (an operator
    audit: every decoder stopped after a daemon crash said so)."""
    with outputs_to_a_dead_daemon(tmp_path) as link:
        async with worker("decoder") as w:
            registered = Registered(instance="decoder-1", key=KEY, heartbeat_s=0.05, push_quarantine_s=1.0)
            w._adopt(registered)
            for _ in range(held):
                w._outputs.put(encode(Heartbeat()))
            with anyio.fail_after(5):
                await w._leave(link, registered)
    warned = [line for line in logs if line["event"] == "worker.outputs_not_handed_over"]
    assert [line["outputs"] for line in warned] == [1] * held


async def test_a_hung_run_is_logged_under_the_workers_registration() -> None:
    """Its line names the instance, as the worker's other lines do (an operator audit: it
    carried none, the watchdog keeping the log it was made with, before registration)."""
    async with worker("decoder") as w:
        w._adopt(Registered(instance="decoder-7", key=b"k" * 16, heartbeat_s=1.0, push_quarantine_s=1.0))
        dog, hung = w._runner._watchdog, []
        dog._on_hung = hung.append  # not the worker's exit
        control = RunControl()
        control.started_at = 100.0
        with dog.watching(control, "r1"), capture_logs() as logs:
            assert dog.check(100.0 + dog.limit_s + 1)
    assert hung == ["r1"] and [(line["event"], line["instance"]) for line in logs] == [("worker.stage_hung",
                                                                                         "decoder-7")]
