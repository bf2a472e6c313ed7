"""Stop signals that come before the daemon's (or a worker's) event loop watches for them.

From the process's start until it opens its signal receiver (imports, the config, logging:
about a third of a second for the daemon, two seconds of torch for a worker), SIGTERM would
kill it outright (exit 143, no line logged) and SIGINT would raise KeyboardInterrupt. Kept
from the first moment (``orchestrator/entry.py``), they are acted on once the process
watches: a stop during start-up is a clean stop, exit 0.
"""

from __future__ import annotations

import signal
from types import FrameType

# SIGHUP (its terminal closed, an SSH session dropped) stops the process as SIGTERM does,
# cleanly, where it killed it mid-request without a word (a crash, to the daemon's workers:
# they waited out push_quarantine_s); unless it was started ignoring SIGHUP (nohup), as
# whoever started it asked.
_HANGUP = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, *_HANGUP)

_heard: list[signal.Signals] | None = None


def keep() -> list[signal.Signals]:
    """Keep every stop signal from now on, in the list returned (the same list each call)."""
    global _heard
    if _heard is None:
        heard: list[signal.Signals] = []

        def kept(signum: int, _frame: FrameType | None) -> None:
            heard.append(signal.Signals(signum))

        for signum in STOP_SIGNALS:
            signal.signal(signum, kept)
        _heard = heard
    return _heard
