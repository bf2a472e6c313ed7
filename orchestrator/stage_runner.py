"""StageRunner: a worker's stage, the threads it runs on and the watchdog over them (the
worker's compute path).

The stage loads on a thread, watched as a run is. A run waits for one of ``compute_threads``
threads, by its request's priority, on a limiter of its own (never behind anyio's shared
40), and is watched from when its thread starts it until that thread returns, stopped or
not: one that outlives ``stage_timeout_s`` ends the process (orchestrator/watchdog.py). Its
end is its request's report: the output staged (a decoder's sent in its ``Done``) or the
failure, saying why; a run stopped or aborted reports nothing, and one that broke the device
ends the process. The runtime (orchestrator/worker.py) starts a run for each ``Work`` or
``Ready`` and keeps its ``RunControl`` to stop it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

import anyio
import torch

from orchestrator.config import WorkerConfig
from orchestrator.limits import oversized_frame
from orchestrator.priority_gate import PriorityGate
from orchestrator.stages import RunControl, Stage, StageError, StageStopped
from orchestrator.stages.base import StepFn, released
from orchestrator.watchdog import EXIT_DEVICE_BROKEN, StageWatchdog
from orchestrator.worker_memory import RequestMemory
from transfer import frames
from transfer.pool import PoolError, PoolTooSmall
from transfer.protocol import Done, Ready, Reason, Role, Step, TensorSpec, Work, brief


class StageRunner:
    def __init__(self, role: Role, wcfg: WorkerConfig, *, log: Any, max_message_bytes: int,
                 report: Callable[..., None], on_hung: Callable[[str], object],
                 exit_after_reports: Callable[[int], None]) -> None:
        self._role = role
        self.stage: Stage | None = None  # once loaded (``load``)
        self._progress_interval_s = wcfg.progress_interval_s
        self._log = log  # the runtime's, bound to its registration (``registered``)
        self._max_message_bytes = max_message_bytes  # until the daemon says its own
        self._report = report
        self._exit_after_reports = exit_after_reports  # on the loop; the process exits
        self._compute = PriorityGate(wcfg.compute_threads)  # the runs it holds wait by priority
        self._threads = anyio.CapacityLimiter(wcfg.compute_threads)  # never behind anyio's shared 40
        self._watchdog = StageWatchdog(wcfg.stage_timeout_s, setting=f"workers.{role}.stage_timeout_s",
                                       log=log, on_hung=on_hung)

    def registered(self, log: Any, max_message_bytes: int) -> None:
        """Take on a registration's log and the daemon's frame limit (its socket cuts off a
        larger frame)."""
        self._log = self._watchdog.log = log
        self._max_message_bytes = max_message_bytes

    async def load(self, build: Callable[[], Stage]) -> None:
        """Start the watchdog, then load the stage with ``build`` on a thread, watched as a run
        is. A load cannot be interrupted, and may take minutes (real weights) or never end (a
        wedged GPU): a stop leaves its thread to end with the process rather than wait for
        it, as SIGTERM must stop a worker at any time, and one that outlives
        stage_timeout_s ends the process as a hung stage run does (else it sat, silent and
        unregistered, for good)."""
        self._watchdog.start()
        loading = RunControl()
        loading.started_at = time.monotonic()
        with self._watchdog.watching(loading, "(the model's load)"):
            self.stage = await anyio.to_thread.run_sync(build, abandon_on_cancel=True)

    def step_reporter(self, rid: str) -> StepFn:
        """For a run whose client asked for progress: called on the stage's thread before
        each step, it hands a ``Step`` to the loop at most every ``progress_interval_s``, and
        only one that moves on (a second-order scheduler runs two timesteps a step)."""
        loop = asyncio.get_running_loop()
        interval_s = self._progress_interval_s
        last, last_done = -math.inf, -1

        def on_step(done: int, total: int) -> None:
            nonlocal last, last_done
            now = time.monotonic()
            if done != last_done and now - last >= interval_s:
                last, last_done = now, done
                loop.call_soon_threadsafe(self._report, Step(request_id=rid, step=done, steps=total))

        return on_step

    def _check_sendable(self, specs: list[TensorSpec]) -> None:
        """The daemon disconnects, unread, a worker that sends it a frame over its
        worker_max_message_bytes (and then takes it for dead): an output that large fails its
        request here instead, saying why."""
        for spec in specs:
            if (problem := oversized_frame(spec.name, spec.nbytes, self._max_message_bytes)) is not None:
                raise StageError(problem, Reason.INVALID)

    async def run(self, order: Work | Ready, control: RunControl, memory: RequestMemory) -> None:
        """Run ``order``'s stage, its inputs (a ``Ready``'s) taken from ``memory``, and stage
        its outputs there (a decoder's go in its ``Done``) or report its failure."""
        rid = order.request_id
        started = time.perf_counter()
        compute_ms = 0.0
        try:
            inputs = memory.take_inputs(order) if isinstance(order, Ready) else {}
            outputs, compute_ms = await self._compute_on_thread(rid, order, inputs, control)
            try:
                await anyio.lowlevel.checkpoint()
            except anyio.get_cancelled_exc_class():
                # Aborted while it ran (a one-pass stage cannot stop early): the daemon
                # expects nothing, so nothing is staged or reported.
                self._log.info("worker.output_dropped", request_id=rid, compute_ms=round(compute_ms))
                raise
            if self._role == "decoder":
                specs, buffers = frames.to_frames(outputs)
                self._check_sendable(specs)
                self._report(Done(request_id=rid, ok=True, compute_ms=compute_ms, outputs=specs), buffers)
            else:
                await memory.stage_output(rid, outputs, compute_ms)
        except StageStopped:
            # The daemon ended the request and freed its slot: it expects no report.
            self._log.info("worker.stage_stopped", request_id=rid, ran_ms=round((time.perf_counter() - started) * 1000))
        except torch.AcceleratorError as exc:
            # A CUDA error (an illegal access, a device-side assert) often leaves the process's
            # GPU context unusable, and torch cannot say which do: every later request would
            # fail here at once, and a worker that fails at once looks idlest to the dispatch.
            # The request fails rather than being started again elsewhere: if it is what
            # faults the device, it would take down worker after worker (daemon.retries).
            self._log.error("worker.device_broken", request_id=rid, error=str(exc), exit_status=EXIT_DEVICE_BROKEN)
            if not control.stopped:  # else the request is over: the daemon expects no Done
                self._report(Done(request_id=rid, ok=False, compute_ms=compute_ms, reason=Reason.STAGE_FAILED,
                                  error=brief(f"the device failed and its worker exits: {exc}")))
            self._exit_after_reports(EXIT_DEVICE_BROKEN)
        except Exception as exc:  # one request's failure must not kill the worker
            if control.stopped:
                # Aborted while it ran, then it failed: the daemon expects no report but the
                # Stopped its Abort asked for.
                self._log.info("worker.stage_stopped", request_id=rid, error=str(exc),
                               ran_ms=round((time.perf_counter() - started) * 1000))
            else:
                self._report(self._failed(rid, exc, compute_ms))

    def _failed(self, rid: str, exc: Exception, compute_ms: float) -> Done:
        """The report of a run that raised ``exc``."""
        reason = Reason.STAGE_FAILED
        match exc:
            case StageError():
                reason, error = exc.reason, str(exc)
            case PoolTooSmall():
                # Never, on this worker: the setting to raise, for the operator.
                reason, error = Reason.TRANSFER_FAILED, (f"no room to stage its output: {exc} "
                                                         f"(workers.{self._role}.pool_bytes)")
            case PoolError():
                # No room to stage the output for its hand-off: a failed hand-off, as when the
                # receiver has none, and like it started again on the workers left (daemon.retries).
                reason, error = Reason.TRANSFER_FAILED, f"no room to stage its output: {exc}"
            case frames.ChecksumMismatch():
                # Its input was written over after it landed (transfer/frames.py): a failed
                # hand-off, started again on the workers left (daemon.retries).
                self._log.warning("worker.input_corrupted", request_id=rid, error=str(exc))
                reason, error = Reason.TRANSFER_FAILED, str(exc)
            case ValueError():
                error = str(exc)
            case _:
                self._log.exception("worker.stage_crashed", request_id=rid)  # called in its except block
                error = f"{type(exc).__name__}: {exc}"
        return Done(request_id=rid, ok=False, compute_ms=compute_ms, reason=reason, error=brief(error))

    async def _compute_on_thread(self, rid: str, order: Work | Ready, inputs: dict[str, torch.Tensor],
                                 control: RunControl) -> tuple[dict[str, torch.Tensor], float]:
        """The stage's outputs, and its compute time in ms: from when a compute thread took
        the run, so that a wait for one (more requests held than threads) counts as the
        stage's queueing, not as its compute."""
        stage = self.stage
        assert stage is not None

        def run() -> tuple[dict[str, torch.Tensor], float]:
            control.started_at = time.monotonic()  # not before: waiting for a compute thread is no hang
            began = time.perf_counter()
            try:
                outputs = stage.run(order.params, inputs, control=control)
            except BaseException as exc:
                if (failure := released(exc)) is exc:
                    raise
                raise failure from None
            # Here, not on the loop: moving a GPU tensor waits for every kernel queued on its
            # device, the next request's included.
            return {name: t.detach().cpu() for name, t in outputs.items()}, (time.perf_counter() - began) * 1000

        # Watched until the thread returns, stopped or not: not cancellable, this await
        # outlasts even the request's end.
        async with self._compute.slot(order.priority):
            with self._watchdog.watching(control, rid):
                return await anyio.to_thread.run_sync(run, limiter=self._threads)
