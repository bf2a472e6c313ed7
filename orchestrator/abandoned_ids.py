"""AbandonedIds: when an ``AsyncClient`` may use a request id again that it gave up on.

A request given up on is cancelled at the daemon, but its answer may still come, and it
must not reach a new request under the same id. So the id is held until its end comes, the
daemon answers its latest Cancel with found=False (its end came first, or its Submit never
got there), or its socket is replaced; else for its wait once more, counted, for one sent
while no daemon was connected, from when one is (that Submit waits in ZMQ's queue for the
next daemon, and leaves first). Bookkeeping only: the client tells it the time, and keeps
the sockets and the waits.
"""

from __future__ import annotations

import math


class AbandonedIds:
    def __init__(self) -> None:
        # By id: until when an answer may still come (inf: until a daemon takes the
        # connection), and for how long to hold it.
        self._holds: dict[str, tuple[float, float]] = {}
        self._cancels_out: dict[str, int] = {}  # Cancels not yet answered, by id

    def held(self, rid: str, now: float) -> bool:
        """Whether an answer to ``rid``, given up on, may still come at ``now``."""
        return self._holds.get(rid, (-math.inf, 0.0))[0] > now

    def drop(self, rid: str) -> bool:
        """Forget ``rid``'s hold, run out or not; whether it had one."""
        return self._holds.pop(rid, None) is not None

    def abandon(self, rid: str, hold_s: float, now: float, *, queued: bool) -> None:
        """``rid`` was given up on at ``now``: hold it ``hold_s``, from now, or from when a
        daemon takes the connection if it was ``queued`` for one. Holds run out are dropped."""
        for old in [old for old, (until, _) in self._holds.items() if until <= now]:
            del self._holds[old]
            self._cancels_out.pop(old, None)
        self._holds[rid] = (math.inf if queued else now + hold_s), hold_s

    def count_holds_from(self, now: float) -> None:
        """A daemon took the connection at ``now``: what waited in ZMQ's queue for one leaves
        first, so the holds of requests sent meanwhile count from now."""
        for rid, (until, hold_s) in self._holds.items():
            if until == math.inf:
                self._holds[rid] = now + hold_s, hold_s

    def count_cancel(self, rid: str) -> None:
        """A Cancel of ``rid`` is about to leave: counted first, as its answer can come
        before the sender runs again."""
        self._cancels_out[rid] = self._cancels_out.get(rid, 0) + 1

    def uncount_cancel(self, rid: str) -> int:
        """One Cancel of ``rid`` fewer out (answered, or it never left); how many are left."""
        owed = self._cancels_out.pop(rid, 0) - 1
        if owed > 0:
            self._cancels_out[rid] = owed
        return max(owed, 0)

    def cancel_answered(self, rid: str, *, found: bool) -> None:
        """The daemon answered a Cancel of ``rid``. It reads a connection in order, so what
        the latest Cancel of an id found nothing of will send no more (an earlier one's may be
        about an earlier request under the id): the hold ends."""
        if not self.uncount_cancel(rid) and not found:
            self._holds.pop(rid, None)

    def clear(self) -> None:
        """The socket was replaced: nothing sent on the old one can be answered now."""
        self._holds.clear()
        self._cancels_out.clear()
