"""Ending with the process that started us (Linux ``PR_SET_PDEATHSIG``).

A cluster's processes must not outlive it, however it ends: a demo killed with SIGTERM or
SIGKILL, or its terminal closed, runs no cleanup of its own. The kernel sends the signal
when the thread that forked the child ends; LocalCluster forks from its caller's thread.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1
# Set by LocalCluster for the processes it starts itself: the pid they end with.
PARENT_ENV = "TRIPTYCH_END_WITH"


def end_with_parent(parent: int) -> bool:
    """Have SIGTERM sent to this process when ``parent`` ends; False if it already has
    (before the request took effect), when nothing will be sent."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    return os.getppid() == parent
