"""Whether a request fits a model: checked by the daemon at the door and by each stage."""

from __future__ import annotations

import msgspec

from orchestrator.config import LimitsConfig
from transfer.protocol import GenParams, StageLimits


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
    if params.steps < limits.min_steps:
        return f"steps {params.steps} is below {limits.min_steps}, the fewest model {limits.model!r} takes"
    if params.steps in limits.step_gaps:
        return (f"steps {params.steps} is a count the scheduler of model {limits.model!r} cannot run (its "
                f"timesteps would leave the trained ones): {_nearest_taken(limits, params.steps)}")
    if params.num_images > limits.max_images:
        return f"num_images {params.num_images} exceeds {limits.max_images} for model {limits.model!r}"
    if params.frames > limits.max_frames:
        return f"frames {params.frames} exceeds {limits.max_frames} for model {limits.model!r}"
    if (pixels := params.pixels) > limits.max_pixels:
        return (f"width x height x frames x num_images = {pixels} pixels exceeds {limits.max_pixels} "
                f"for model {limits.model!r}")
    return None


def _nearest_taken(limits: StageLimits, steps: int) -> str:
    below = next((n for n in range(steps - 1, limits.min_steps - 1, -1) if n not in limits.step_gaps), None)
    above = next((n for n in range(steps + 1, limits.max_steps + 1) if n not in limits.step_gaps), None)
    return " or ".join(str(n) for n in (below, above) if n is not None) + " can"


def oversized_frame(name: str, nbytes: int, limit: int, *, foreseen: bool = False) -> str | None:
    """Why output ``name`` of ``nbytes`` cannot reach the client, or None: the daemon's worker
    socket cuts off, unread, a decoder that sends a frame over ``limit``
    (daemon.worker_max_message_bytes). ``foreseen``: said of a request, before it runs."""
    if nbytes <= limit:
        return None
    return (f"output {name!r} {'would be' if foreseen else 'is'} {nbytes} bytes, more than the daemon takes in one "
            f"frame (daemon.worker_max_message_bytes = {limit}): ask for fewer or smaller images, or raise the limit")


def raw_output_violation(params: GenParams, limit: int) -> str | None:
    """Why a ``raw`` request's output (one uint8 tensor of N x H x W x 3 bytes, its size
    known from the request) cannot reach the client, or None. A PNG's size is known only
    once encoded: the decoder checks it (orchestrator/stage_runner.py)."""
    if params.output != "raw":
        return None
    return oversized_frame("images", params.pixels * 3, limit, foreseen=True)


class UnsatisfiableLimits(ValueError):
    """Caps ([model.limits]) under which no request at all could be admitted."""


def unsatisfiable(limits: StageLimits) -> str | None:
    """Why no request at all fits ``limits`` (caps set below the model's smallest size), or None."""
    smallest = -(-limits.min_size // limits.size_multiple) * limits.size_multiple
    if smallest > limits.max_size:
        return f"max_size {limits.max_size} is below the smallest size {smallest} model {limits.model!r} takes"
    if smallest * smallest > limits.max_pixels:
        return f"max_pixels {limits.max_pixels} is below one {smallest}x{smallest} image of model {limits.model!r}"
    if limits.min_steps > limits.max_steps:
        return (f"max_steps {limits.max_steps} is below the {limits.min_steps} steps model {limits.model!r} "
                "takes at least")
    return None


def capped(limits: StageLimits, caps: LimitsConfig) -> StageLimits:
    """``limits`` lowered to the operator's caps (``[model.limits]``; 0 leaves the model's).
    A ``max_size`` between two multiples of the model's size step becomes the lower one, and
    a ``max_steps`` on a count the scheduler cannot run the next one below it, so the limit
    a rejection names is one that is actually taken."""
    lowered = {name: min(getattr(limits, name), cap) for name in caps.__struct_fields__
               if (cap := getattr(caps, name))}
    if "max_size" in lowered and lowered["max_size"] >= limits.size_multiple:  # else unsatisfiable says why
        lowered["max_size"] -= lowered["max_size"] % limits.size_multiple
    while lowered.get("max_steps") in limits.step_gaps:  # below min_steps: unsatisfiable says why
        lowered["max_steps"] -= 1
    return msgspec.structs.replace(limits, **lowered)
