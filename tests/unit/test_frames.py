"""Tensors <-> staged blocks and ZMQ frames: layouts, round trips, lying headers."""

from __future__ import annotations

import msgspec
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer import frames
from transfer.frames import from_frames, layout, pack, to_frames, unpack
from transfer.protocol import TensorSpec
from transfer.specs import ALIGNMENT, ITEMSIZE

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool]

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 200, shape, generator=g).to(dtype)


tensor_dicts = st.dictionaries(
    st.text(min_size=1, max_size=8),
    st.tuples(st.sampled_from(DTYPES), shapes, st.integers(0, 2**31)).map(lambda a: make_tensor(*a)),
    max_size=5,
)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype
        assert got[name].shape == t.shape
        assert torch.equal(got[name], t), name


def packed(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[TensorSpec]]:
    specs, total = layout(tensors)
    block = torch.zeros(total, dtype=torch.uint8)
    return block, pack(block, tensors, specs)


# --------------------------------------------------------------------------- staged blocks


@given(tensor_dicts)
def test_layout_offsets_are_aligned_and_disjoint(tensors: dict[str, torch.Tensor]) -> None:
    specs, total = layout(tensors)
    spans = sorted((s.offset, s.offset + s.nbytes) for s in specs)
    assert all(s.offset % ALIGNMENT == 0 for s in specs)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start
    assert total % ALIGNMENT == 0
    assert all(end <= total for _, end in spans)


def test_layout_specs_describe_each_tensor() -> None:
    specs, total = layout({"a": torch.zeros(3, dtype=torch.float32), "b": torch.zeros(2, 2, dtype=torch.int64)})
    assert specs == [
        TensorSpec(name="a", dtype="float32", shape=(3,), offset=0, nbytes=12),
        TensorSpec(name="b", dtype="int64", shape=(2, 2), offset=256, nbytes=32),
    ]
    assert total == 512


@settings(max_examples=50)
@given(tensor_dicts)
def test_pack_unpack_round_trips(tensors: dict[str, torch.Tensor]) -> None:
    block, specs = packed(tensors)
    assert_same(unpack(block, specs), tensors)


def test_unpack_copies_out_of_the_block() -> None:
    """The block is recycled after unpacking, so the tensors must not alias it."""
    block, specs = packed({"x": torch.arange(4, dtype=torch.float32)})
    out = unpack(block, specs)
    block.fill_(0)
    assert torch.equal(out["x"], torch.arange(4, dtype=torch.float32))


def test_pack_vouches_for_each_tensor_with_a_digest_of_its_bytes() -> None:
    tensors = {"a": torch.arange(5, dtype=torch.float32), "b": torch.zeros(0, dtype=torch.uint8)}
    _, specs = packed(tensors)
    assert [s.xxh3 for s in specs] == [xxhash.xxh3_64_intdigest(t.numpy().tobytes()) for t in tensors.values()]


@pytest.mark.parametrize("where", ["first", "last"])
def test_bytes_written_over_a_staged_tensor_are_caught_by_name(where: str) -> None:
    """A late write landing in the block after its hand-off: the copy taken differs."""
    block, specs = packed({"embeds": torch.ones(64), "latents": torch.ones(64)})
    spec = specs[-1]
    block[spec.offset + (0 if where == "first" else spec.nbytes - 1)] ^= 1
    with pytest.raises(frames.ChecksumMismatch, match="tensor 'latents': its bytes are not those its sender staged"):
        unpack(block, specs)


def test_a_spec_without_a_digest_is_taken_unchecked() -> None:
    """An older sender's hand-off (the field is optional on the wire)."""
    block, specs = packed({"x": torch.arange(4, dtype=torch.float32)})
    block[0] ^= 1
    unchecked = [msgspec.structs.replace(spec, xxh3=None) for spec in specs]
    assert not torch.equal(unpack(block, unchecked)["x"], torch.arange(4, dtype=torch.float32))


def test_non_contiguous_tensor_packs_by_value() -> None:
    t = torch.arange(12, dtype=torch.int64).reshape(3, 4).t()
    block, specs = packed({"t": t})
    assert torch.equal(unpack(block, specs)["t"], t)


def test_unstageable_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="complex64"):
        layout({"z": torch.zeros(2, dtype=torch.complex64)})


# --------------------------------------------------------------------------- frames


@settings(max_examples=50)
@given(tensor_dicts)
def test_frames_round_trip_one_frame_per_tensor(tensors: dict[str, torch.Tensor]) -> None:
    specs, buffers = to_frames(tensors)
    assert len(buffers) == len(specs) == len(tensors)
    assert_same(from_frames(specs, [bytes(b) for b in buffers]), tensors)


def test_frames_survive_the_wire_header() -> None:
    """Specs go through msgpack and the frames as bytes, as the decoder sends them."""
    tensors = {"img": torch.arange(24, dtype=torch.uint8).reshape(2, 3, 4), "m": torch.ones(3, dtype=torch.bfloat16)}
    specs, buffers = to_frames(tensors)
    wire_specs = msgspec.msgpack.decode(msgspec.msgpack.encode(specs), type=list[TensorSpec])
    assert_same(from_frames(wire_specs, [bytes(b) for b in buffers]), tensors)


def test_a_writable_frame_is_used_in_place_and_a_read_only_one_copied() -> None:
    """A client keeps its bytearray frames: tensors over them hold the outputs once, not twice."""
    specs, buffers = to_frames({"a": torch.arange(4, dtype=torch.uint8)})
    writable, read_only = bytearray(buffers[0]), bytes(buffers[0])
    over, copied = from_frames(specs, [writable])["a"], from_frames(specs, [read_only])["a"]
    writable[0] = 9
    assert over[0] == 9 and copied[0] == 0
    copied[1] = 7  # writable, without touching the bytes
    assert read_only[1] == 1


def test_frame_count_mismatch_is_refused() -> None:
    specs, buffers = to_frames({"a": torch.zeros(2), "b": torch.zeros(2)})
    with pytest.raises(ValueError, match="2 tensor headers but 1 frames"):
        from_frames(specs, buffers[:1])


# --------------------------------------------------------------------------- lying headers


def spec(**overrides: object) -> TensorSpec:
    fields = {"name": "liar", "dtype": "float32", "shape": (2, 3), "offset": 0, "nbytes": 24} | overrides
    return TensorSpec(**fields)


def test_unpack_wrong_nbytes_names_the_tensor() -> None:
    with pytest.raises(ValueError, match="'liar'.*25 bytes"):
        unpack(torch.zeros(512, dtype=torch.uint8), [spec(nbytes=25)])


def test_unpack_offset_beyond_block_names_the_tensor() -> None:
    with pytest.raises(ValueError, match="'liar'.*outside"):
        unpack(torch.zeros(256, dtype=torch.uint8), [spec(offset=240)])


def test_unpack_negative_dimension_names_the_tensor() -> None:
    with pytest.raises(ValueError, match="'liar'.*negative"):
        unpack(torch.zeros(256, dtype=torch.uint8), [spec(shape=(-2, 3))])


@pytest.mark.parametrize("shape", [(2**62, 2**62, 0), (2**63, 0), (0, 2**64)])
def test_an_empty_shape_no_tensor_can_have_is_refused_by_name(shape: tuple[int, ...]) -> None:
    """No bytes, but dimensions torch cannot count: a ValueError like any bad header, not
    torch's RuntimeError or TypeError from the reshape."""
    with pytest.raises(ValueError, match="'liar'.*past what a tensor can have"):
        unpack(torch.zeros(256, dtype=torch.uint8), [spec(shape=shape, nbytes=0)])
    with pytest.raises(ValueError, match="'liar'.*past what a tensor can have"):
        from_frames([spec(shape=shape, nbytes=0)], [b""])


def test_unpack_unknown_dtype_names_the_tensor() -> None:
    with pytest.raises(ValueError, match="'liar'"):
        unpack(torch.zeros(256, dtype=torch.uint8), [spec(dtype="float128")])


def test_from_frames_size_mismatch_names_the_tensor() -> None:
    with pytest.raises(ValueError, match="'liar'.*frame has 20 bytes"):
        from_frames([spec()], [b"\0" * 20])


def test_from_frames_unknown_dtype_names_the_tensor() -> None:
    with pytest.raises(ValueError, match="'liar'"):
        from_frames([spec(dtype="quaternion")], [b"\0" * 24])


def test_dtype_names_round_trip() -> None:
    for dtype in DTYPES:
        assert frames.torch_dtype(frames.dtype_name(dtype)) == dtype


def test_the_daemon_s_item_sizes_are_torch_s() -> None:
    """The daemon checks outputs without torch (transfer/specs.py): its table must agree."""
    assert set(ITEMSIZE) == set(frames._DTYPES)
    for name, dtype in frames._DTYPES.items():
        assert ITEMSIZE[name] == torch.empty((), dtype=dtype).element_size(), name
