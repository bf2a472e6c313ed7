"""Tensors <-> bytes without pickle: a ``TensorSpec`` header plus raw memory.

Two layouts share the same specs:

* frames: one ZMQ frame per tensor (the decoder's output to the client);
* staged blocks: tensors packed one after another, 256-byte aligned, in one contiguous
  region of a registered pool, so a single Mooncake write moves a whole hand-off.

Every decode checks the header against the bytes, so a lying or corrupted header becomes
a ``ValueError`` naming the tensor, never a crash or a silent misread.

A staged tensor also carries a digest of its bytes (XXH3-64), taken from the stage's own
tensor as it is packed and checked on the private copy the receiver takes. Memory a write
may still land in is reused only after ``push_quarantine_s``, but nothing bounds how long a
sender frozen mid-write (SIGSTOP, a paused container) stays frozen, and its write goes on
when it wakes: the bytes it lands late in memory that meanwhile took another request's
hand-off are caught here, whichever memory they hit, instead of reaching that request's
client.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec
import torch
import xxhash

from transfer.protocol import TensorSpec
from transfer.specs import align_up, check_frames, check_headers, expected_nbytes

_DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name, dtype in {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float64": torch.float64,
        "uint8": torch.uint8,
        "int8": torch.int8,
        "int32": torch.int32,
        "int64": torch.int64,
        "bool": torch.bool,
    }.items()
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {name} cannot travel between stages")
    return name


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}") from None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor (bf16 has no numpy twin, uint8 does)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def _digest(raw: torch.Tensor) -> int:
    """XXH3-64 of a flat uint8 CPU tensor: ~30 GB/s here, a fraction of the copy it checks
    (zlib's CRC-32, at 4 GB/s, was slower than the copy: docs/benchmarks.md)."""
    return xxhash.xxh3_64_intdigest(raw.numpy())


class ChecksumMismatch(ValueError):
    """A staged tensor's bytes are not those its sender packed: memory written out of turn."""


# --------------------------------------------------------------------------- staged blocks


def layout(tensors: Mapping[str, torch.Tensor]) -> tuple[list[TensorSpec], int]:
    """Offsets for packing ``tensors`` into one block; returns the specs and total size."""
    specs: list[TensorSpec] = []
    offset = 0
    for name, t in tensors.items():
        size = _nbytes(t)
        specs.append(
            TensorSpec(name=name, dtype=dtype_name(t.dtype), shape=tuple(t.shape), offset=offset, nbytes=size)
        )
        offset = align_up(offset + size)
    check_headers(specs)
    return specs, offset


def pack(block: torch.Tensor, tensors: Mapping[str, torch.Tensor], specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """Copy ``tensors`` into the uint8 region ``block`` at the offsets ``layout`` chose;
    returns ``specs`` with each tensor's digest, taken from the tensor, not the block (a write
    landing in the block meanwhile must not be vouched for)."""
    packed: list[TensorSpec] = []
    for spec in specs:
        src = _bytes_view(tensors[spec.name])
        block[spec.offset : spec.offset + spec.nbytes].copy_(src)
        packed.append(msgspec.structs.replace(spec, xxh3=_digest(src)))
    return packed


def unpack(block: torch.Tensor, specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
    """Tensors copied out of the uint8 region ``block`` (the region is recycled after).

    The specs must lie in order and apart, as ``layout`` puts them: overlapping ones would
    let a short input be copied out many times over. A spec with a digest is checked against
    the copy, which nothing else can write to: ``ChecksumMismatch`` if they differ.
    """
    out: dict[str, torch.Tensor] = {}
    end = 0
    for spec in specs:
        size = expected_nbytes(spec)
        if size != spec.nbytes:
            raise ValueError(f"tensor {spec.name!r}: header says {spec.nbytes} bytes, shape needs {size}")
        if spec.offset < end:
            raise ValueError(f"tensor {spec.name!r}: at {spec.offset}, inside the tensor before it (ends at {end})")
        if spec.offset + size > block.numel():
            raise ValueError(f"tensor {spec.name!r}: [{spec.offset}, +{size}) outside a {block.numel()}-byte block")
        end = spec.offset + size
        raw = block[spec.offset : spec.offset + size].clone()
        if spec.xxh3 is not None and (digest := _digest(raw)) != spec.xxh3:
            raise ChecksumMismatch(f"tensor {spec.name!r}: its bytes are not those its sender staged (XXH3 "
                                   f"{digest:#018x}, staged {spec.xxh3:#018x}): a write landed in this memory "
                                   "out of turn, or the link corrupted it")
        out[spec.name] = raw.view(torch_dtype(spec.dtype)).reshape(spec.shape)
    return out


# --------------------------------------------------------------------------- frames


def to_frames(tensors: Mapping[str, torch.Tensor]) -> tuple[list[TensorSpec], list[memoryview]]:
    """Specs and zero-copy buffers, one per tensor, for ``send_multipart(copy=False)``.

    The caller keeps ``tensors`` alive until ZMQ has sent the frames.
    """
    specs: list[TensorSpec] = []
    buffers: list[memoryview] = []
    for name, t in tensors.items():
        raw = _bytes_view(t)
        specs.append(TensorSpec(name=name, dtype=dtype_name(t.dtype), shape=tuple(t.shape), nbytes=raw.numel()))
        buffers.append(memoryview(raw.numpy()))
    check_headers(specs)
    return specs, buffers


def from_frames(specs: Sequence[TensorSpec],
                frames: Sequence[bytes | bytearray | memoryview]) -> dict[str, torch.Tensor]:
    """Tensors built from received frames; checks count and sizes.

    A ``bytearray`` frame is used in place, the tensor sharing its memory; any other is
    copied once: ZMQ frames are read-only and torch wants writable memory.
    """
    check_frames(specs, frames)
    out: dict[str, torch.Tensor] = {}
    for spec, frame in zip(specs, frames, strict=True):
        data = frame if isinstance(frame, bytearray) else bytearray(frame)
        raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        out[spec.name] = raw.view(torch_dtype(spec.dtype)).reshape(spec.shape)
    return out
