"""LocalCluster.stop: every process it started is gone afterwards, even past one that would not stop."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.cluster import ClusterError, LocalCluster

CONFIG = Path(__file__).parents[2] / "configs" / "test.toml"
DEAF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"


def test_a_daemon_deaf_to_sigterm_is_killed_and_named_and_the_workers_still_stop(tmp_path: Path) -> None:
    cluster = LocalCluster(CONFIG, log_dir=tmp_path)
    cluster.daemon = subprocess.Popen([sys.executable, "-c", DEAF], stdout=subprocess.PIPE, text=True)
    assert cluster.daemon.stdout is not None and cluster.daemon.stdout.readline() == "ready\n"
    cluster.workers = {f"encoder{i}": subprocess.Popen(["sleep", "60"]) for i in range(2)}
    with pytest.raises(ClusterError, match=r"^daemon did not exit within 0.5s of SIGTERM; killed$"):
        cluster.stop(timeout_s=0.5)
    assert all(proc.poll() is not None for proc in [cluster.daemon, *cluster.workers.values()])
    assert [proc.returncode for proc in cluster.workers.values()] == [-15, -15]
    cluster.daemon.stdout.close()


def test_leaving_the_with_block_on_an_error_stops_everything_and_keeps_that_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test that failed inside ``with LocalCluster(...)`` must report its own failure, not
    the teardown's: the killed daemon is news only when nothing else went wrong."""
    cluster = LocalCluster(CONFIG, log_dir=tmp_path)
    cluster.daemon = subprocess.Popen([sys.executable, "-c", DEAF], stdout=subprocess.PIPE, text=True)
    assert cluster.daemon.stdout is not None and cluster.daemon.stdout.readline() == "ready\n"
    monkeypatch.setattr(cluster, "stop", functools.partial(LocalCluster.stop, cluster, timeout_s=0.5))
    failure = ValueError("the test's own failure")
    cluster.__exit__(ValueError, failure, None)  # as a with block that raised it leaves; no ClusterError
    assert cluster.daemon.poll() is not None
    cluster.daemon.stdout.close()
    cluster.daemon = subprocess.Popen([sys.executable, "-c", DEAF], stdout=subprocess.PIPE, text=True)
    assert cluster.daemon.stdout is not None and cluster.daemon.stdout.readline() == "ready\n"
    with pytest.raises(ClusterError, match="daemon did not exit"):
        cluster.__exit__(None, None, None)  # a clean block: the kill is the news
    cluster.daemon.stdout.close()


def stopped(pid: int) -> None:
    """Return once ``pid`` is stopped: a SIGTERM sent before a SIGSTOP takes effect comes first."""
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"{pid} did not stop"
        time.sleep(0.01)


def test_frozen_workers_share_one_deadline_rather_than_one_each(tmp_path: Path) -> None:
    """Workers frozen with SIGSTOP never act on SIGTERM: each was waited for timeout_s after
    the one before, so a stop took timeout_s once per frozen worker (3 of them: 3 x 0.5 s)."""
    cluster = LocalCluster(CONFIG, log_dir=tmp_path)
    cluster.workers = {f"denoiser{i}": subprocess.Popen(["sleep", "60"]) for i in range(3)}
    for proc in cluster.workers.values():
        os.kill(proc.pid, signal.SIGSTOP)
        stopped(proc.pid)
    started = time.monotonic()
    with pytest.raises(ClusterError, match=r"^denoiser0, denoiser1, denoiser2 did not exit within 0.5s of SIGTERM"):
        cluster.stop(timeout_s=0.5)
    assert time.monotonic() - started < 1.0
    assert [proc.returncode for proc in cluster.workers.values()] == [-signal.SIGKILL] * 3
