"""The worker fork server: its children are what `python -m orchestrator …` would be, and the
parent learns how each one ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.fork_server import ForkServer, ForkServerError
from tests.e2e.conftest import cluster_config


def start_server(tmp_path: Path) -> ForkServer:
    return ForkServer(tmp_path / "fork-server.log", env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    running = start_server(tmp_path_factory.mktemp("forks"))
    yield running
    running.close()


def waiting_worker(tmp_path: Path) -> list[str]:
    """A worker's command line whose daemon never comes: it waits, alive, for a minute."""
    path, _ = cluster_config(tmp_path, **{"workers.encoder": {"connect_timeout_s": 60.0}})
    return ["worker", "--role", "encoder", "--config", str(path)]


def events(log: Path) -> list[str]:
    return [json.loads(line)["event"] for line in log.read_text().splitlines() if line.startswith("{")]


def wait_for_event(log: Path, event: str) -> None:
    deadline = time.monotonic() + 30
    while event not in (events(log) if log.exists() else []):
        assert time.monotonic() < deadline, f"no {event} in {log}"
        time.sleep(0.05)


def test_a_child_runs_the_command_in_a_session_of_its_own_and_its_death_by_signal_is_reported(
    server: ForkServer, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    child = server.spawn(waiting_worker(tmp_path), log=log, append=False)
    wait_for_event(log, "worker.waiting_for_daemon")
    assert os.getsid(child.pid) == child.pid  # a signal to the test's process group misses it
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.1)
    child.kill()
    assert child.wait(timeout=10) == -signal.SIGKILL
    child.kill()  # ended: no signal to a pid that may belong to someone else now
    assert child.poll() == -signal.SIGKILL


def test_the_exit_status_and_output_of_a_failing_command_come_back(server: ForkServer, tmp_path: Path) -> None:
    log = tmp_path / "stats.log"
    log.write_text("an earlier cluster's line\n")
    command = ["stats", "--config", str(tmp_path / "missing.toml")]
    child = server.spawn(command, log=log, append=False)
    assert child.wait(timeout=30) == 1
    output = log.read_text()
    assert "an earlier cluster's line" not in output and "triptych stats: [Errno 2] No such file" in output
    again = server.spawn(command, log=log, append=True)
    assert again.wait(timeout=30) == 1
    assert log.read_text().count("No such file") == 2  # a restart's log keeps the story


def test_the_server_exits_when_closed_though_a_child_still_runs(tmp_path: Path) -> None:
    """The children hold none of the server's pipes: its end is seen at once."""
    own = start_server(tmp_path)
    log = tmp_path / "worker.log"
    child = own.spawn(waiting_worker(tmp_path), log=log, append=False)
    wait_for_event(log, "worker.waiting_for_daemon")
    started = time.monotonic()
    own.close()
    assert time.monotonic() - started < 5
    os.kill(child.pid, 0)  # alive: stopping its workers is the cluster's job, done before this
    with pytest.raises(ForkServerError, match="exited before worker"):
        child.poll()
    with pytest.raises(ForkServerError, match="is closed"):
        own.spawn(waiting_worker(tmp_path), log=log, append=True)
    os.kill(child.pid, signal.SIGKILL)
