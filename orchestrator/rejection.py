"""``Rejection``: what a client raises when the daemon answers ``Rejected``.

Its own module, free of torch, so that code which only needs to catch it (the CLI's
outermost handler, which every process runs, the daemon included) does not load torch:
that costs a process ~190 MiB and makes each of the daemon's garbage collections walk
torch's objects.
"""

from __future__ import annotations

from transfer.protocol import Rejected


class Rejection(Exception):
    """The daemon answered ``Rejected``."""

    def __init__(self, rejected: Rejected) -> None:
        super().__init__(f"{rejected.reason}: {rejected.message}")
        self.rejected = rejected
        self.reason = rejected.reason

    def __reduce__(self) -> tuple[type[Rejection], tuple[Rejected]]:
        # Pickled as what it was made from (job queues and process pools pickle exceptions).
        return Rejection, (self.rejected,)
