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


def limits_violation(limits: StageLimits, params: GenParams) -> str | None:
    """The first way ``params`` break ``limits``, as a message for the client, or None."""
    for axis in ("width", "height"):
        value = getattr(params, axis)
        if value % limits.size_multiple:
            return f"{axis} {value} is not a multiple of {limits.size_multiple} for model {limits.model!r}"
        if not limits.min_size <= value <= limits.max_size:
            return f"{axis} {value} is outside [{limits.min_size}, {limits.max_size}] for model {limits.model!r}"
    if params.steps > limits.max_steps:
        return f"steps {params.steps} exceeds {limits.max_steps} for model {limits.model!r}"
    if params.num_images > limits.max_images:
        return f"num_images {params.num_images} exceeds {limits.max_images} for model {limits.model!r}"
    if params.frames > limits.max_frames:
        return f"frames {params.frames} exceeds {limits.max_frames} for model {limits.model!r}"
    return None
