"""What a ``TensorSpec`` promises, checked without torch (the daemon never imports it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transfer.protocol import MAX_DIMS, MAX_TENSOR_NAME, MAX_TENSORS, TensorSpec

# Every tensor, staged block and preallocated slot starts on this boundary.
ALIGNMENT = 256


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


# Bytes per element of every dtype that may travel between stages (transfer/frames.py maps
# the same names to torch dtypes).
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "uint8": 1, "int8": 1, "int32": 4,
            "int64": 8, "bool": 1}


# torch counts elements in int64, dimension by dimension, zeros included: a shape whose
# non-zero dimensions multiply past this is refused there (with a RuntimeError, not ours).
_MAX_ELEMENTS = 2**63 - 1


def expected_nbytes(spec: TensorSpec) -> int:
    """The bytes ``spec``'s dtype and shape take; ``ValueError`` for a spec no tensor can have."""
    count, nonzero = 1, 1
    for dim in spec.shape:
        if dim < 0:
            raise ValueError(f"tensor {spec.name!r}: negative dimension in {spec.shape}")
        count *= dim
        nonzero *= dim or 1
    if nonzero > _MAX_ELEMENTS:
        raise ValueError(f"tensor {spec.name!r}: shape {spec.shape} is past what a tensor can have")
    try:
        return count * ITEMSIZE[spec.dtype]
    except KeyError:
        raise ValueError(f"tensor {spec.name!r}: unknown dtype {spec.dtype!r}") from None


def check_headers(specs: Sequence[TensorSpec]) -> None:
    """Raise ``ValueError`` for headers the wire refuses: a worker checks its stage's outputs
    with this before it reports them, or the daemon would drop the report unread."""
    if len(specs) > MAX_TENSORS:
        raise ValueError(f"{len(specs)} output tensors; a hand-off or result carries at most {MAX_TENSORS}")
    for spec in specs:
        if len(spec.name) > MAX_TENSOR_NAME:
            raise ValueError(f"tensor name {spec.name[:32]!r}... is {len(spec.name)} characters, "
                             f"more than {MAX_TENSOR_NAME}")
        if len(spec.shape) > MAX_DIMS:
            raise ValueError(f"tensor {spec.name!r} has {len(spec.shape)} dimensions, more than {MAX_DIMS}")


def check_frames(specs: Sequence[TensorSpec], frames: Sequence[Any]) -> None:
    """Raise ``ValueError`` unless ``frames`` (anything with a buffer) are the tensors ``specs`` describe."""
    if len(specs) != len(frames):
        raise ValueError(f"{len(specs)} tensor headers but {len(frames)} frames")
    for spec, frame in zip(specs, frames, strict=True):
        size = expected_nbytes(spec)
        nbytes = memoryview(frame).nbytes
        if nbytes != size:
            raise ValueError(f"tensor {spec.name!r}: frame has {nbytes} bytes, header needs {size}")
