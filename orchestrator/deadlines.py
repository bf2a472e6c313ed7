"""Deadlines as the clients take them: a positive, finite number of seconds."""

from __future__ import annotations

import math


def checked_s(timeout_s: float) -> float:
    """``timeout_s`` if it is a deadline (finite, positive), else ``ValueError``: a wait
    of -1 or infinity would never end, and one of 0 would never wait. ``TypeError`` naming
    it for what is no number (a "10" read from a config's text)."""
    try:
        finite = math.isfinite(timeout_s)
    except TypeError:
        raise TypeError(f"timeout_s must be a number of seconds, not {type(timeout_s).__name__}") from None
    if not (finite and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, not {timeout_s!r}")
    return timeout_s


# ZMQ's poll takes a C int of milliseconds (24.8 days): a longer wait polls again, or ends there.
MAX_POLL_MS = 2**31 - 1


def poll_ms(timeout_s: float) -> int:
    """``timeout_s`` as ZMQ poll milliseconds: at least 1 (0 would not wait at all), at most
    what ZMQ takes (a longer one raised OverflowError, after its message had gone)."""
    return min(max(1, math.ceil(checked_s(timeout_s) * 1000)), MAX_POLL_MS)
