"""The stage interface: plain synchronous torch code the worker runtime calls in a thread.

A stage never sees sockets, pools or Mooncake. It takes the request's parameters and the
tensors the previous stage produced, and returns the tensors the next stage (or, for the
decoder, the client) receives. Anything it raises fails that request alone.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import ClassVar

import torch

from orchestrator.limits import limits_violation
from transfer.protocol import GenParams, Reason, Role, StageLimits

Tensors = dict[str, torch.Tensor]
ProgressFn = Callable[[int, int], None]


class StageError(Exception):
    """A failure about this request's data, reported to its client with ``reason``."""

    def __init__(self, message: str, reason: Reason = Reason.STAGE_FAILED) -> None:
        super().__init__(message)
        self.reason = reason


class Stage(abc.ABC):
    """One pipeline stage loaded in one worker process."""

    role: ClassVar[Role]

    @abc.abstractmethod
    def limits(self) -> StageLimits:
        """What this stage's model can honour; sent to the daemon at registration."""

    @abc.abstractmethod
    def run(self, params: GenParams, inputs: Tensors) -> Tensors:
        """Compute this stage for one request. Runs in a worker thread; may block."""

    def check(self, params: GenParams) -> None:
        """Raise ``StageError(reason=INVALID)`` if ``params`` are outside ``limits()``."""
        problem = limits_violation(self.limits(), params)
        if problem:
            raise StageError(problem, Reason.INVALID)
