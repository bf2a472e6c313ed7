"""What both clients (``orchestrator.client``) send and read: the ``Submit`` they encode,
their cancel tokens, the replies they decode, and how long they wait for them."""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio

from orchestrator.endpoints import dial_problem
from orchestrator.rejection import Rejection
from transfer.protocol import (
    CLIENT_REPLY,
    CLIENT_REQUEST,
    DAEMON_TO_WORKER,
    DECODE_ERRORS,
    PROTOCOL_VERSION,
    Cancel,
    Cancelled,
    GenParams,
    Progress,
    Reason,
    RegisterRefused,
    Rejected,
    Result,
    Submit,
    encode,
)
from transfer.specs import check_frames

if TYPE_CHECKING:
    import torch

# How long past the request's own deadline a client waits for the daemon's answer.
GRACE_S = 5.0
DEFAULT_TIMEOUT_S = 120.0
# How long the Cancel of a request given up on (a wait interrupted, timed out or abandoned,
# or a client closed under it) may take to leave.
CANCEL_SEND_S = 1.0


@dataclass(frozen=True)
class Generation:
    """A finished request: its header and its outputs, as received."""

    result: Result
    frames: list[bytearray]  # each ``result.outputs`` tensor's bytes, in that order, checked against it

    @functools.cached_property
    def outputs(self) -> dict[str, torch.Tensor]:
        """The output tensors by name, over the frames' memory. Torch is imported here, on
        first use: a caller that only writes the bytes out, as ``triptych submit`` does,
        starts without it (~2 s)."""
        from transfer.frames import from_frames

        return from_frames(self.result.outputs, self.frames)


@dataclass(frozen=True, slots=True)
class Lost:
    """No answer can come to a waiting request (``ConnectionWatch.problem`` says why)."""

    why: str


@dataclass(frozen=True, slots=True)
class Unreadable:
    """The connection brought an answer no client socket gives (``read_reply`` says why): no
    request on it can be answered, as the blocking client's ``ValueError`` says at once."""

    why: str


Reply = Generation | Rejected | Cancelled | Progress  # what the client socket brings, decoded


class CancelTokens:
    """Each request's ``cancel_token``, derived from a secret of one client object and the
    request's id: its ``Cancel``s carry it from whichever socket (the blocking client cancels
    on a fresh one), and nobody without the secret can stop its requests."""

    def __init__(self) -> None:
        self._secret = secrets.token_bytes(16)

    def of(self, request_id: str) -> str:
        if not isinstance(request_id, str):
            # A TypeError, as any other field of the wrong type (a submit's is a Rejection,
            # not sent), not an AttributeError from inside the HMAC.
            raise TypeError(f"request_id must be a str, not {type(request_id).__name__}")
        # surrogatepass: an id that is no text is refused when its Submit is encoded, not here.
        return hmac.new(self._secret, request_id.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:32]

    def cancel_frame(self, request_id: str) -> bytes:
        return encode(Cancel(protocol=PROTOCOL_VERSION, request_id=request_id, cancel_token=self.of(request_id)))


def daemon_endpoint(endpoint: str) -> str:
    """``endpoint``, or ``ValueError`` if no client can connect there (malformed, or a ``*``
    only the daemon can bind): ZMQ would say only "Invalid argument". ``TypeError`` for one
    that is no str (a ``Path``, bytes, a None from a config), not one from inside the check."""
    if not isinstance(endpoint, str):
        raise TypeError(f"endpoint must be a str such as 'tcp://host:5555', not {type(endpoint).__name__}")
    if (problem := dial_problem(endpoint)) is not None:
        raise ValueError(f"{endpoint} is {problem}")
    return endpoint


def blocking_context(ctx: zmq.Context | None) -> zmq.Context:
    """``ctx`` for a blocking client's sockets (ZMQ's shared one if None); ``TypeError`` for a
    ``zmq.asyncio`` one, whose sockets return futures where a blocking client waits for
    frames (the type allows it: it is a ``zmq.Context`` too)."""
    if ctx is None:
        return zmq.Context.instance()
    if isinstance(ctx, zmq.asyncio.Context):
        raise TypeError("a zmq.asyncio.Context serves asyncio code: use AsyncClient there, or give a zmq.Context")
    return ctx


def submit_body(params: GenParams, request_id: str, timeout_s: float | None, priority: int, tokens: CancelTokens,
                 progress: bool = False) -> bytes:
    """The encoded ``Submit``, checked as the daemon will check it: a bad field raises
    ``Rejection(invalid)`` here, at once. (A field far out of bounds, a prompt of megabytes,
    would otherwise be cut off unread at the daemon's size limit, and get no answer.)

    The request carries the deadline the client waits for (``DEFAULT_TIMEOUT_S`` when the
    caller names none), so the daemon never works on past the caller's patience.
    """
    return _checked(request_id, lambda: Submit(
        protocol=PROTOCOL_VERSION, params=params, request_id=request_id, timeout_s=_or_default(timeout_s),
        priority=priority, progress=progress, cancel_token=tokens.of(request_id)))


def cancel_body(request_id: str, tokens: CancelTokens) -> bytes:
    """The encoded ``Cancel`` of ``request_id``, checked as ``submit_body`` checks a Submit: an
    id no request can have (not a str, empty, past 128 characters) raises ``Rejection(invalid)``
    here, unsent, as a submit's does (the daemon's own refusal would cost a round trip)."""
    return _checked(request_id, lambda: Cancel(protocol=PROTOCOL_VERSION, request_id=request_id,
                                               cancel_token=tokens.of(request_id)))


def _checked(request_id: str, message: Callable[[], Submit | Cancel]) -> bytes:
    """``message()`` encoded, once the daemon's decoder takes it; else ``Rejection(invalid)``."""
    try:
        # Encoding fails first for an int msgpack cannot carry (a seed past 2**64).
        body = encode(message())
        CLIENT_REQUEST.decode(body)
    except (msgspec.ValidationError, OverflowError, TypeError, UnicodeEncodeError) as exc:
        # TypeError: a value msgpack has no form for (a numpy integer, say), or an id that is
        # no str; UnicodeEncodeError: a string that is no text (a lone surrogate).
        raise Rejection(Rejected(request_id=request_id, reason=Reason.INVALID, message=f"not sent: {exc}")) from None
    return body


def cancel_found(ack: Cancelled) -> bool:
    """Whether ``ack``'s Cancel found its request; ``PermissionError`` if the daemon refused it."""
    if ack.refused:
        raise PermissionError(f"request {ack.request_id!r} was submitted by another client: only its submitter "
                              "may cancel it")
    return ack.found


def decode_reply(parts: list[bytes]) -> Reply:
    """The reply (an unreadable header raises ``msgspec.DecodeError``). A ``Result`` whose
    frames are not its tensors is a ``Rejected`` for its own request."""
    if not parts:
        raise msgspec.DecodeError("a reply of no frames")
    header = CLIENT_REPLY.decode(parts[0])
    if isinstance(header, Result):
        try:
            check_frames(header.outputs, parts[1:])
            return Generation(header, [bytearray(part) for part in parts[1:]])  # writable, for torch
        except ValueError as exc:
            return Rejected(request_id=header.request_id, reason=Reason.INVALID, message=f"unreadable Result: {exc}")
    return header


def read_reply(frames: list[bytes], endpoint: str) -> Reply:
    """The reply in ``frames``; ``ValueError`` if they are none, saying which socket answered
    where the daemon's worker socket did."""
    try:
        return decode_reply(frames)
    except DECODE_ERRORS as exc:
        said = worker_socket_said(frames[0]) if frames else None
        raise ValueError(f"{endpoint} is not a Triptych client socket: "
                         f"{said or f'its answer is unreadable ({exc})'}") from None


def worker_socket_said(body: bytes) -> str | None:
    """What the daemon's worker socket answered, if ``body`` is its answer (None if not): a
    client's or control command's request sent there gets a ``RegisterRefused`` that says
    which socket it is, which beats msgspec's words about a field of it."""
    try:
        answer = DAEMON_TO_WORKER.decode(body)
    except DECODE_ERRORS:
        return None
    return answer.message if isinstance(answer, RegisterRefused) else "it answered as a worker socket"


def _or_default(timeout_s: float | None) -> float:
    # Not ``timeout_s or ...``: a 0 must be refused as the bad value it is, not read as "none".
    return DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s


def wait_s(timeout_s: float | None) -> float:
    return _or_default(timeout_s) + GRACE_S

