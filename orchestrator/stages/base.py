"""The stage interface: plain synchronous torch code the worker runtime calls in a thread.

A stage never sees sockets, pools or Mooncake. It takes the request's parameters and the
tensors the previous stage produced, and returns the tensors the next stage (or, for the
decoder, the client) receives. Anything it raises fails that request alone.

A request can end while its stage runs (cancelled, timed out, failed elsewhere): the worker
then sets the run's ``StopFlag``, and a stage that loops (the denoiser, step by step) checks
it between iterations, so an abandoned request gives its GPU back within one step instead of
finishing work nobody will read.
"""

from __future__ import annotations

import abc
import threading
from typing import ClassVar

import torch

from orchestrator.limits import limits_violation
from transfer.protocol import GenParams, Reason, Role, StageLimits

Tensors = dict[str, torch.Tensor]


class StageError(Exception):
    """A failure about this request's data, reported to its client with ``reason``."""

    def __init__(self, message: str, reason: Reason = Reason.STAGE_FAILED) -> None:
        super().__init__(message)
        self.reason = reason


class StageStopped(Exception):
    """The run's request ended while it ran; nobody waits for its output."""


class StopFlag:
    """Set by the worker's event loop, read by the stage's thread."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def check(self) -> None:
        """Raise ``StageStopped`` if the request has ended."""
        if self._event.is_set():
            raise StageStopped

    def sleep(self, seconds: float) -> None:
        """``time.sleep`` that ends early, raising ``StageStopped``, when the request ends."""
        if self._event.wait(seconds):
            raise StageStopped


class _NeverStop(StopFlag):
    def set(self) -> None:
        raise RuntimeError("NEVER is shared: make a StopFlag of your own to stop a run")


NEVER = _NeverStop()  # for runs outside a worker (tests, tools): nothing stops them


class Stage(abc.ABC):
    """One pipeline stage loaded in one worker process."""

    role: ClassVar[Role]

    @abc.abstractmethod
    def limits(self) -> StageLimits:
        """What this stage's model can honour; sent to the daemon at registration."""

    @abc.abstractmethod
    def run(self, params: GenParams, inputs: Tensors, *, stop: StopFlag = NEVER) -> Tensors:
        """Compute this stage for one request. Runs in a worker thread; may block. A stage
        that loops calls ``stop.check()`` between iterations."""

    def check(self, params: GenParams) -> None:
        """Raise ``StageError(reason=INVALID)`` if ``params`` are outside ``limits()``."""
        problem = limits_violation(self.limits(), params)
        if problem:
            raise StageError(problem, Reason.INVALID)
