"""The stage interface: plain synchronous torch code the worker runtime calls in a thread.

A stage never sees sockets, pools or Mooncake. It takes the request's parameters and the
tensors the previous stage produced, and returns the tensors the next stage (or, for the
decoder, the client) receives. Anything it raises fails that request alone.

Each run gets a ``RunControl``. A stage that loops (the denoiser, step by step) calls its
``step`` before each iteration: that reports progress when the client asked for it, and
raises ``StageStopped`` once the request has ended (cancelled, timed out, failed elsewhere),
so an abandoned request gives its GPU back within one step instead of finishing work nobody
will read.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import json
import threading
from collections.abc import Callable
from typing import ClassVar

import torch

from orchestrator.config import LimitsConfig
from orchestrator.limits import capped, limits_violation
from transfer.protocol import GenParams, Reason, Role, StageLimits

Tensors = dict[str, torch.Tensor]


def digest_of(value: object) -> str:
    """A short digest of a JSON-able value, the same in every process and on every host."""
    return hashlib.blake2b(json.dumps(value, sort_keys=True).encode(), digest_size=8).hexdigest()


class StageError(Exception):
    """A failure about this request's data, reported to its client with ``reason``."""

    def __init__(self, message: str, reason: Reason = Reason.STAGE_FAILED) -> None:
        super().__init__(message)
        self.reason = reason


def released(exc: BaseException) -> BaseException:
    """What a stage's failure ``exc`` becomes once the request's memory is let go of.

    Its traceback holds the stage's frames, their locals the request's tensors (GPU memory),
    and a cycle through the worker thread's future keeps them until the garbage collector
    happens to run: the locals go now, the lines stay for the log. Out of GPU memory, the
    allocator's cache goes back to the card, which other workers share, and the request
    fails as any other (``stage_failed``), without a crash's traceback."""
    tb = exc.__traceback__
    while tb is not None:
        with contextlib.suppress(RuntimeError):  # the frame still running: the caller's own
            tb.tb_frame.clear()
        tb = tb.tb_next
    if _out_of_gpu_memory(exc):
        torch.cuda.empty_cache()
        first_line = next(iter(str(exc).splitlines()), "")
        return StageError(f"out of GPU memory for this request: {first_line}".rstrip(": "))
    return exc


# Running out of GPU memory outside torch's allocator: cudaMalloc for a kernel's own use (a
# torch.AcceleratorError, "CUDA error: out of memory"), cuBLAS's or cuDNN's workspace (a
# plain RuntimeError). None of them poisons the GPU context, as an illegal access does.
_ALLOCATION_FAILURES = ("CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


def _out_of_gpu_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _ALLOCATION_FAILURES)


class ModelUnloadable(Exception):
    """The configured model cannot be loaded for this role: a missing directory or part, the
    wrong family for it, a device this machine lacks. A setup mistake, said in one line."""


class StageStopped(Exception):
    """The run's request ended while it ran; nobody waits for its output."""


StepFn = Callable[[int, int], None]  # (steps done, steps in all), called before each step


class RunControl:
    """One stage run's link to its worker: stopped from the worker's event loop, read and
    stepped from the stage's thread."""

    def __init__(self, on_step: StepFn | None = None) -> None:
        self._stopped = threading.Event()
        self._on_step = on_step
        self.started_at: float | None = None  # monotonic; set by the worker when the run's thread starts it

    def stop(self) -> None:
        self._stopped.set()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def check(self) -> None:
        """Raise ``StageStopped`` if the request has ended."""
        if self._stopped.is_set():
            raise StageStopped

    def step(self, done: int, total: int) -> None:
        """Before each step of a loop: ``done`` of ``total`` are finished."""
        self.check()
        if self._on_step is not None:
            self._on_step(done, total)

    def sleep(self, seconds: float) -> None:
        """``time.sleep`` that ends early, raising ``StageStopped``, when the request ends."""
        if self._stopped.wait(seconds):
            raise StageStopped


class _Unattended(RunControl):
    def stop(self) -> None:
        raise RuntimeError("UNATTENDED is shared: give a run a RunControl of its own to stop it")


UNATTENDED = _Unattended()  # for runs outside a worker (tests, tools): nobody stops or watches them


class Stage(abc.ABC):
    """One pipeline stage loaded in one worker process."""

    role: ClassVar[Role]
    # The operator's caps ([model.limits]), set by ``build_stage``.
    caps: LimitsConfig = LimitsConfig()

    @abc.abstractmethod
    def model_limits(self) -> StageLimits:
        """What this stage's model can honour."""

    @abc.abstractmethod
    def model_digest(self) -> str:
        """A short digest of what the three roles must agree on to hand each other tensors:
        the model's configs, and the seed of weights made from one. Every worker of one
        daemon must give the same (the daemon refuses a worker that does not)."""

    def limits(self) -> StageLimits:
        """What this stage takes: its model's limits under the operator's caps. Sent to the
        daemon at registration, which refuses requests outside them at its door."""
        return capped(self.model_limits(), self.caps)

    @abc.abstractmethod
    def run(self, params: GenParams, inputs: Tensors, *, control: RunControl = UNATTENDED) -> Tensors:
        """Compute this stage for one request. Runs in a worker thread; may block. A stage
        that loops calls ``control.step(done, total)`` before each iteration."""

    def check(self, params: GenParams) -> None:
        """Raise ``StageError(reason=INVALID)`` if ``params`` are outside ``limits()``."""
        problem = limits_violation(self.limits(), params)
        if problem:
            raise StageError(problem, Reason.INVALID)
