"""``triptych submit --progress`` against a fake daemon that streams progress with no pause:
a stop signal still ends it cleanly, its request cancelled at the daemon."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.actors.progress_flood import ROOT, ProgressFlood


@pytest.mark.parametrize(("signum", "status", "said"), [(signal.SIGINT, 130, "interrupted"),
                                                         (signal.SIGTERM, 143, "terminated")], ids=["int", "term"])
def test_a_stop_signal_amid_a_stream_of_progress_cancels_the_request_quietly(tmp_path: Path, signum: signal.Signals,
                                                                             status: int, said: str) -> None:
    """SIGTERM was raised where the process stood: under a stream of progress, in the
    client's reader mid-receive most often, which ended the reader, and the client's close
    printed that as a crash (a traceback before the "terminated" line). And a reader that
    took every queued reply without letting the loop run never let the cancellation in."""
    endpoint = f"ipc://{tmp_path}/daemon"
    with ProgressFlood(endpoint) as flood:
        submit = subprocess.Popen([sys.executable, "-m", "orchestrator", "submit", "--prompt", "x", "--progress",
                                   "--request-id", "r", "--endpoint", endpoint, "--out", str(tmp_path)],
                                  cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert flood.flooding.wait(timeout=20)
        time.sleep(0.5)  # well into the stream, where the client's reader runs nearly all the time
        submit.send_signal(signum)
        _, stderr = submit.communicate(timeout=20)
    assert submit.returncode == status, stderr
    assert "Traceback" not in stderr, stderr
    assert stderr.strip().endswith(f"{said}: request r cancelled")
    assert flood.heard == [("Submit", "r"), ("Cancel", "r")]
