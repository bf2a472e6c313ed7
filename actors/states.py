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
