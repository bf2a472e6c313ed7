"""The wire protocol: every message round-trips through its decoder; bad input names itself."""

from __future__ import annotations

import ast
import functools
import typing
from pathlib import Path

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer import protocol as p

# Every module-level decoder, and each message type its union accepts.
DECODERS: dict[str, msgspec.msgpack.Decoder] = {
    name: getattr(p, name)
    for name in ("CLIENT_REQUEST", "CLIENT_REPLY", "CONTROL_REQUEST", "CONTROL_REPLY", "WORKER_MESSAGE",
                 "DAEMON_TO_WORKER", "WORK_ORDER")
}
CASES = [(name, cls) for name, decoder in DECODERS.items() for cls in typing.get_args(decoder.type)]

# msgpack integers are 64-bit; unconstrained ints are drawn from that range.
INT64 = (-(2**63), 2**63 - 1)
MAX_TEXT = 24  # keep examples small: the codec, not the allocator, is under test
MAX_ITEMS = 3


# --------------------------------------------------------------------------- strategies


def _bound(lo: int | float | None, hi: int | float | None, default: tuple[int, int]) -> tuple:
    return (default[0] if lo is None else lo, default[1] if hi is None else hi)


def strategy_for(t: mi.Type) -> st.SearchStrategy:
    """A strategy honouring the ``msgspec.Meta`` constraints ``msgspec.inspect`` reports.

    ``st.from_type`` would ignore those constraints and draw values (``width=0``) the
    decoder rightly refuses, so the strategy is derived from the decoder's own view.
    """
    match t:
        case mi.IntType(gt=gt, ge=ge, lt=lt, le=le):
            lo = ge if ge is not None else (gt + 1 if gt is not None else None)
            hi = le if le is not None else (lt - 1 if lt is not None else None)
            lo, hi = _bound(lo, hi, INT64)
            return st.integers(lo, hi)
        case mi.FloatType(gt=gt, ge=ge, lt=lt, le=le):
            return st.floats(
                min_value=ge if ge is not None else gt,
                max_value=le if le is not None else lt,
                exclude_min=ge is None and gt is not None,
                exclude_max=le is None and lt is not None,
                allow_nan=False,
            )
        case mi.StrType(min_length=lo, max_length=hi):
            return st.text(min_size=lo or 0, max_size=min(hi if hi is not None else MAX_TEXT, MAX_TEXT))
        case mi.BytesType():
            return st.binary(max_size=MAX_TEXT)
        case mi.BoolType():
            return st.booleans()
        case mi.NoneType():
            return st.none()
        case mi.LiteralType(values=values):
            return st.sampled_from(values)
        case mi.EnumType(cls=cls):
            return st.sampled_from(cls)
        case mi.ListType(item_type=item):
            return st.lists(strategy_for(item), max_size=MAX_ITEMS)
        case mi.VarTupleType(item_type=item):
            return st.lists(strategy_for(item), max_size=MAX_ITEMS).map(tuple)
        case mi.DictType(key_type=key, value_type=value):
            return st.dictionaries(strategy_for(key), strategy_for(value), max_size=MAX_ITEMS)
        case mi.UnionType(types=types):
            return st.one_of([strategy_for(u) for u in types])
        case mi.StructType(cls=cls, fields=fields):
            return st.builds(cls, **{f.name: strategy_for(f.type) for f in fields})
        case _:
            raise NotImplementedError(f"no strategy for {t!r}")


@functools.cache
def message(cls: type) -> st.SearchStrategy:
    return strategy_for(mi.type_info(cls))


# --------------------------------------------------------------------------- round trips


def test_every_wire_class_has_a_decoder() -> None:
    """Every tagged wire message is a member of some decoder's union, so it is round-tripped below."""
    covered = {cls for _, cls in CASES}
    wire_classes = {c for c in vars(p).values() if isinstance(c, type) and issubclass(c, p.Wire) and c is not p.Wire}
    assert wire_classes <= covered


@pytest.mark.parametrize(("decoder_name", "cls"), CASES, ids=[f"{n}-{c.__name__}" for n, c in CASES])
@settings(max_examples=25)  # 30 message types: keeps the whole file to a few seconds
@given(data=st.data())
def test_message_round_trips(decoder_name: str, cls: type, data: st.DataObject) -> None:
    msg = data.draw(message(cls))
    assert DECODERS[decoder_name].decode(p.encode(msg)) == msg


@given(st.builds(p.Submit, protocol=st.just(p.PROTOCOL_VERSION), params=st.builds(p.GenParams, prompt=st.text())))
def test_submit_with_defaults_round_trips(msg: p.Submit) -> None:
    """A Submit built with mostly default fields decodes to an equal Submit."""
    assert p.CLIENT_REQUEST.decode(p.encode(msg)) == msg


@pytest.mark.parametrize("digest", [0, 2**63, 2**64 - 1])
def test_a_digest_past_int64_crosses_the_wire(digest: int) -> None:
    """XXH3-64 digests fill 64 unsigned bits (msgpack's uint64)."""
    spec = p.TensorSpec(name="latents", dtype="float32", shape=(4,), nbytes=16, xxh3=digest)
    staged = p.WORKER_MESSAGE.decode(p.encode(p.Staged(request_id="r", nbytes=16, manifest=[spec], compute_ms=1.0)))
    assert staged.manifest[0].xxh3 == digest


def test_tag_is_the_class_name() -> None:
    assert msgspec.msgpack.decode(p.encode(p.Heartbeat())) == {"kind": "Heartbeat"}


# --------------------------------------------------------------------------- bad input


WRONG_KIND = {
    "CLIENT_REQUEST": p.Heartbeat(),
    "CLIENT_REPLY": p.GetStats(),
    "CONTROL_REQUEST": p.Cancel(protocol=1, request_id="r1"),
    "CONTROL_REPLY": p.Heartbeat(),
    "WORKER_MESSAGE": p.Abort(request_id="r1"),
    "DAEMON_TO_WORKER": p.Heartbeat(),
    "WORK_ORDER": p.Heartbeat(),
}


@pytest.mark.parametrize("decoder_name", sorted(WRONG_KIND))
def test_wrong_kind_is_a_validation_error_naming_the_tag(decoder_name: str) -> None:
    wrong = WRONG_KIND[decoder_name]
    with pytest.raises(msgspec.ValidationError) as info:
        DECODERS[decoder_name].decode(p.encode(wrong))
    assert type(wrong).__name__ in str(info.value)
    assert "$.kind" in str(info.value)


def test_bad_field_error_names_its_path() -> None:
    bad = p.Submit(protocol=p.PROTOCOL_VERSION, params=p.GenParams(prompt="x", width=0))
    with pytest.raises(msgspec.ValidationError, match=r"\$\.params\.width"):
        p.CLIENT_REQUEST.decode(p.encode(bad))


def test_empty_request_id_is_refused_in_cancel() -> None:
    with pytest.raises(msgspec.ValidationError, match=r"\$\.request_id"):
        p.CLIENT_REQUEST.decode(p.encode(p.Cancel(protocol=1, request_id="")))


def test_a_submits_id_and_priority_are_bounded() -> None:
    """The id comes back in every reply and log line, and priorities past the documented
    range would let one client jump every queue: the wire takes 128 characters and -100..100."""
    def submit(**fields: object) -> p.Submit:
        return p.Submit(protocol=p.PROTOCOL_VERSION, params=p.GenParams(prompt="x"), **fields)

    for fine in (submit(request_id="r" * 128), submit(priority=100), submit(priority=-100)):
        assert p.CLIENT_REQUEST.decode(p.encode(fine)) == fine
    for bad, path in ((submit(request_id="r" * 129), "request_id"), (submit(priority=101), "priority"),
                      (submit(priority=-101), "priority")):
        with pytest.raises(msgspec.ValidationError, match=rf"- at `\$\.{path}`$"):
            p.CLIENT_REQUEST.decode(p.encode(bad))


def test_the_largest_valid_submit_fits_the_client_sockets_smallest_frame_limit() -> None:
    """daemon.client_max_message_bytes may not go below MAX_SUBMIT_BYTES: a Submit past the
    socket's limit is cut off with its connection, its client told nothing but that."""
    largest = p.Submit(protocol=p.PROTOCOL_VERSION, request_id=WIDE * 128, priority=-100, timeout_s=86400.0,
                       progress=True, cancel_token=WIDE * 64,
                       params=p.GenParams(prompt=WIDE * 16384, negative_prompt=WIDE * 16384, width=16384,
                                          height=16384, frames=4096, steps=1000, guidance=100.0,
                                          seed=2**63 - 1, num_images=16, output="raw"))
    assert p.CLIENT_REQUEST.decode(p.encode(largest)) == largest
    assert len(p.encode(largest)) <= p.MAX_SUBMIT_BYTES


def test_unknown_fields_are_skipped() -> None:
    """An older peer decodes a newer peer's message that carries an extra field."""
    raw = msgspec.msgpack.encode({"kind": "Abort", "request_id": "r1", "added_later": [1, 2]})
    assert p.WORK_ORDER.decode(raw) == p.Abort(request_id="r1")


def test_garbage_bytes_are_a_decode_error() -> None:
    with pytest.raises(msgspec.DecodeError):
        p.CLIENT_REQUEST.decode(b"\xc1not msgpack")


# --------------------------------------------------------------------------- roles


def test_next_role_follows_the_pipeline() -> None:
    assert [p.next_role(r) for r in p.ROLES] == ["denoiser", "decoder", None]


def test_hop_name_joins_sender_and_receiver() -> None:
    assert p.hop_name("encoder", "denoiser") == "encoder->denoiser"


def test_stats_from_a_daemon_before_finishing_slots_still_decode() -> None:
    """Control messages carry no version: a field added to Stats needs a default, or a newer
    `triptych stats` or exporter cannot read an older daemon."""
    old = {"instance": "decoder-1", "role": "decoder", "name": "d", "address": "a", "session": "s",
           "slots_free": 1, "slots_total": 1, "prealloc_free": 0, "prealloc_total": 0, "served": 0, "failed": 0,
           "alive": True}
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=p.InstanceStats).slots_finishing == 0


# --------------------------------------------------------------------------- what workers may say

WIDE = "\U0010ffff"  # four bytes in UTF-8: the most a bounded string can weigh
LARGEST = 2**63 - 1


def _largest_spec() -> p.TensorSpec:
    return p.TensorSpec(name=WIDE * p.MAX_TENSOR_NAME, dtype=WIDE * 16, shape=(LARGEST,) * p.MAX_DIMS,
                        offset=LARGEST, nbytes=LARGEST)


def test_no_order_can_outgrow_a_work_socket_frame() -> None:
    """The daemon relays what workers register and report (sessions, shared-memory paths,
    tensor headers) and what clients ask (prompts) in its orders to other workers. A frame
    over a work socket's limit is dropped whole, with the connection, and its request would
    wait for nothing: the wire's bounds keep the largest order the daemon can build under it."""
    from orchestrator.work_socket import ORDER_MAX_MESSAGE_BYTES

    label = WIDE * 512
    params = p.GenParams(prompt=WIDE * 16384, negative_prompt=WIDE * 16384)
    manifest = [_largest_spec()] * p.MAX_TENSORS
    # Every relayed piece is as large as the decoders that take it from workers and clients allow.
    registered = p.Register(protocol=p.PROTOCOL_VERSION, token=label, role="denoiser", name=label,
                            work_address=label, session=label, pool_base=0, pool_size=1, slots=[], capacity=1,
                            write_timeout_s=5.0,
                            local=p.LocalMemory(host=label, path=label, device=LARGEST, inode=LARGEST,
                                                base=LARGEST, size=LARGEST))
    staged = p.Staged(request_id="r", nbytes=LARGEST, manifest=manifest, compute_ms=1e9)
    assert p.WORKER_MESSAGE.decode(p.encode(registered)) == registered
    assert p.WORKER_MESSAGE.decode(p.encode(staged)) == staged
    rid = WIDE * 128
    assert p.CLIENT_REQUEST.decode(p.encode(p.Submit(protocol=p.PROTOCOL_VERSION, params=params, request_id=rid)))
    orders = [
        p.Work(request_id=rid, params=params, part=LARGEST, parts=LARGEST, progress=True),
        p.Ready(request_id=rid, params=params, address=LARGEST, manifest=manifest, slot_id=LARGEST, progress=True),
        p.Push(request_id=rid, session=registered.session, address=LARGEST, nbytes=LARGEST, part=LARGEST,
               local=registered.local),
    ]
    for order in orders:
        assert len(p.encode(order)) < ORDER_MAX_MESSAGE_BYTES


@pytest.mark.parametrize("report", [
    p.Register(protocol=p.PROTOCOL_VERSION, token="t", role="encoder", name="e", work_address="ipc://w",
               session="x" * 513, pool_base=0, pool_size=1, slots=[], capacity=1, write_timeout_s=5.0),
    p.Staged(request_id="r", nbytes=1, manifest=[_largest_spec()] * (p.MAX_TENSORS + 1), compute_ms=1.0),
    p.Done(request_id="r", ok=True, compute_ms=1.0,
           outputs=[p.TensorSpec(name="image", dtype="uint8", shape=(1,) * (p.MAX_DIMS + 1))]),
    p.Register(protocol=p.PROTOCOL_VERSION, token="t", role="decoder", name="d", work_address="ipc://w",
               session="s", pool_base=0, pool_size=1 << 30,
               slots=[p.SlotInfo(slot_id=i, address=i * 256, size=256) for i in range(p.MAX_SLOTS + 1)], capacity=1,
               write_timeout_s=5.0),
    p.Register(protocol=p.PROTOCOL_VERSION, token="t", role="decoder", name="d", work_address="ipc://w",
               session="s", pool_base=0, pool_size=1024, slots=[p.SlotInfo(slot_id=0, address=0, size=0)],
               capacity=1, write_timeout_s=5.0),
    p.Register(protocol=p.PROTOCOL_VERSION, token="t", role="decoder", name="d", work_address="ipc://w",
               session="s", pool_base=0, pool_size=1024, slots=[], capacity=0, write_timeout_s=5.0),
], ids=["session", "manifest", "dimensions", "slots", "empty slot", "no capacity"])
def test_what_a_worker_registers_and_reports_is_bounded(report: p.Wire) -> None:
    with pytest.raises(msgspec.ValidationError):
        p.WORKER_MESSAGE.decode(p.encode(report))


@pytest.mark.parametrize("duration", [float("nan"), float("inf"), -1.0])
def test_a_duration_a_worker_reports_is_a_finite_number_of_ms(duration: float) -> None:
    """One NaN in the daemon's running means would make every later ETA and latency total NaN."""
    for report in (p.Staged(request_id="r", nbytes=1, manifest=[], compute_ms=duration),
                   p.Pushed(request_id="r", ok=True, transfer_ms=duration),
                   p.Done(request_id="r", ok=False, compute_ms=duration)):
        with pytest.raises(msgspec.ValidationError, match=r"_ms"):
            p.WORKER_MESSAGE.decode(p.encode(report))


# --------------------------------------------------------------------------- no pickle on any wire

ROOT = Path(__file__).resolve().parents[2]
PICKLING_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "shelve"}
PICKLING_HELPERS = {"send_pyobj", "recv_pyobj"}  # pyzmq's: pickle.dumps/loads around a frame


def pickle_uses(source: str) -> list[str]:
    """Where ``source`` imports a pickling module or calls pyzmq's pickling helpers."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            # __import__("pickle"), importlib.import_module("pickle")
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if called in {"__import__", "import_module"}:
                names = [str(node.args[0].value)]
        if any(name.split(".")[0] in PICKLING_MODULES for name in names):
            found.append(f"line {node.lineno}: imports {', '.join(names)}")
        attr = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if attr in PICKLING_HELPERS:
            found.append(f"line {node.lineno}: {attr}")
    return found


def test_the_pickle_guard_sees_every_way_in() -> None:
    for source in ("import pickle", "import pickle as p", "from pickle import loads", "import cloudpickle",
                   "from _pickle import Unpickler", "__import__('pickle')", "importlib.import_module('dill')",
                   "sock.recv_pyobj()", "await sock.send_pyobj(x)", "from zmq import Socket\nrecv = Socket.recv_pyobj"):
        assert pickle_uses(source), source
    assert pickle_uses("import msgspec\nsock.recv_multipart()\n# pickle.loads is not used") == []


def test_no_daemon_worker_or_transfer_module_unpickles_anything() -> None:
    """Reference defect 17: pickle on a socket runs whatever a peer sends. Every wire here
    is typed msgspec; nothing under orchestrator/, actors/ or transfer/ may import pickle
    (or a module built on it) or use pyzmq's send_pyobj/recv_pyobj."""
    files = [path for package in ("orchestrator", "actors", "transfer")
             for path in sorted((ROOT / package).rglob("*.py"))]
    assert len(files) > 30  # the packages were found
    offenders = {str(path.relative_to(ROOT)): uses for path in files
                 if (uses := pickle_uses(path.read_text(encoding="utf-8")))}
    assert offenders == {}
