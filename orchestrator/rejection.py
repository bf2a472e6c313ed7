"""``Rejection``: what a client raises when the daemon answers ``Rejected``; ``answer_as``:
the one check of every answer's kind.

Its own module, free of torch, so that code which only needs to catch it (the CLI's
outermost handler, which every process runs, the daemon included) does not load torch:
that costs a process ~190 MiB and makes each of the daemon's garbage collections walk
torch's objects.
"""

from __future__ import annotations

from typing import TypeVar

from transfer.protocol import Reason, Rejected

Answer = TypeVar("Answer")


class Rejection(Exception):
    """The daemon answered ``Rejected``."""

    def __init__(self, rejected: Rejected) -> None:
        super().__init__(f"{rejected.reason}: {rejected.message}")
        self.rejected = rejected
        self.reason = rejected.reason

    def __reduce__(self) -> tuple[type[Rejection], tuple[Rejected]]:
        # Pickled as what it was made from (job queues and process pools pickle exceptions).
        return Rejection, (self.rejected,)


def from_another_socket(rejection: Rejection) -> bool:
    """Whether ``rejection`` is the answer of a socket of the daemon's that could not read the
    message as one of its own: invalid, and naming no request. The clients and the commands
    send nothing their own socket would refuse so (they check it first), so it says that
    the endpoint is another of the daemon's sockets (its message says which)."""
    return rejection.reason == Reason.INVALID and not rejection.rejected.request_id


def answer_as(kind: type[Answer], reply: object, endpoint: str) -> Answer:
    """``reply`` if it is the ``kind`` of answer asked for. ``Rejection`` for a ``Rejected``;
    ``ValueError`` for any other: the peer at ``endpoint`` is no Triptych daemon's socket of
    that kind, or has a bug, and saying so beats an assertion (which ``python -O`` skips)."""
    if isinstance(reply, kind):
        return reply
    if isinstance(reply, Rejected):
        raise Rejection(reply)
    raise ValueError(f"{endpoint} answered with {type(reply).__name__} where {kind.__name__} was due")
