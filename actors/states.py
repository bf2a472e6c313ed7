"""The request state machine, as a table.

A request is owned by one stage at a time. Terminal states are never stored: the tracker
counts them and forgets the request, so anything arriving later finds nothing to change.
"""

from __future__ import annotations

import enum

from transfer.protocol import Role


class RequestState(enum.StrEnum):
    ENCODING = "encoding"
    DENOISING = "denoising"
    DECODING = "decoding"
    DONE = "done"
    FAILED = "failed"


ACTIVE_BY_ROLE: dict[Role, RequestState] = {
    "encoder": RequestState.ENCODING,
    "denoiser": RequestState.DENOISING,
    "decoder": RequestState.DECODING,
}

# Where a request in each state may be, for messages: a state lasts from the hand-off into
# its stage to the hand-off out of it, so it also covers waiting for the next stage.
WHERE: dict[RequestState, str] = {
    RequestState.ENCODING: "queued for an encoder, encoding, or its embeddings waiting for a denoiser",
    RequestState.DENOISING: "denoising, or its latents waiting for a decoder",
    RequestState.DECODING: "decoding",
}

ALLOWED: dict[RequestState, frozenset[RequestState]] = {
    RequestState.ENCODING: frozenset({RequestState.DENOISING, RequestState.FAILED}),
    RequestState.DENOISING: frozenset({RequestState.DECODING, RequestState.FAILED}),
    RequestState.DECODING: frozenset({RequestState.DONE, RequestState.FAILED}),
    RequestState.DONE: frozenset(),
    RequestState.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


def check_move(current: RequestState, new: RequestState) -> None:
    if new not in ALLOWED[current]:
        raise IllegalTransition(f"{current} -> {new}")
