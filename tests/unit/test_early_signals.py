"""Which signals stop a process cleanly: SIGHUP too, unless the process was started ignoring it."""

from __future__ import annotations

import signal
import subprocess
import sys

SIGNALS_OF_A_FRESH_PROCESS = ("import orchestrator.early_signals as e; "
                              "print(' '.join(s.name for s in e.STOP_SIGNALS))")


def stop_signals(*, hangup_ignored: bool) -> list[str]:
    """STOP_SIGNALS as a process started so sees them (ignored signals are inherited across exec)."""
    def start() -> None:
        if hangup_ignored:
            signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup does

    run = subprocess.run([sys.executable, "-c", SIGNALS_OF_A_FRESH_PROCESS], preexec_fn=start,
                         capture_output=True, text=True, timeout=60, check=True)
    return run.stdout.split()


def test_a_hangup_stops_as_sigterm_does() -> None:
    assert stop_signals(hangup_ignored=False) == ["SIGTERM", "SIGINT", "SIGHUP"]


def test_a_process_started_under_nohup_still_ignores_hangups() -> None:
    assert stop_signals(hangup_ignored=True) == ["SIGTERM", "SIGINT"]
