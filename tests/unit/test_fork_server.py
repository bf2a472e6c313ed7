"""The worker fork server: its children are what `python -m orchestrator …` would be, and the
parent learns how each one ends."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from orchestrator import cli, fork_server
from orchestrator.cluster import ClusterError, LocalCluster
from orchestrator.fork_server import ForkServer, ForkServerError
from tests.e2e.conftest import CONFIGS, cluster_config

CONFIG = CONFIGS / "test.toml"


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
    assert Path(f"/proc/{child.pid}/cmdline").read_text().startswith(f"{sys.executable} -m orchestrator worker --role")
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
    assert "an earlier cluster's line" not in output and "triptych stats: cannot read the config file" in output
    again = server.spawn(command, log=log, append=True)
    assert again.wait(timeout=30) == 1
    assert log.read_text().count("No such file") == 2  # a restart's log keeps the story


def test_closing_the_server_ends_its_children_and_says_their_exit_status_is_lost(tmp_path: Path) -> None:
    """The children hold none of the server's plumbing, so its end is seen at once; they get
    SIGTERM as it ends (a server killed, or whose parent died, leaves no worker behind)."""
    own = start_server(tmp_path)
    log = tmp_path / "worker.log"
    child = own.spawn(waiting_worker(tmp_path), log=log, append=False)
    wait_for_event(log, "worker.waiting_for_daemon")
    started = time.monotonic()
    own.close()
    assert time.monotonic() - started < 5
    with pytest.raises(ForkServerError, match="exited before worker .* exit status is lost"):
        child.wait(timeout=30)
    assert "worker.signal" in events(log)  # SIGTERM: it stopped as told, not killed
    assert not alive(child.pid)
    with pytest.raises(ForkServerError, match="is closed"):
        own.spawn(waiting_worker(tmp_path), log=log, append=True)


def test_a_cluster_whose_fork_server_was_killed_still_stops_every_worker_and_names_them(tmp_path: Path) -> None:
    own = start_server(tmp_path)
    cluster = LocalCluster(CONFIG, log_dir=tmp_path, forks=own)
    workers = [cluster.start_worker("encoder", i, config_path=Path(waiting_worker(tmp_path)[-1])) for i in range(2)]
    for i in range(2):
        wait_for_event(tmp_path / f"encoder{i}.log", "worker.waiting_for_daemon")
    os.kill(own.pid, signal.SIGKILL)  # as the kernel's OOM killer would
    with pytest.raises(ClusterError, match=r"^encoder0: .*exit status is lost.*; encoder1: .*exit status is lost"):
        cluster.stop(timeout_s=10)
    assert not any(alive(worker.pid) for worker in workers)
    with pytest.raises(ForkServerError, match="exit status is lost"):
        workers[0].poll()  # as often as asked
    assert not any(is_pidfd(worker.pidfd) for worker in workers)
    own.close()


def test_a_spawn_given_up_on_is_killed_when_it_comes_and_the_next_spawn_gets_its_own_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Answers are matched to spawns by id: a late one is not the next spawn's. The server's
    imports print on its stdout, which is not the channel, and start a process of their own,
    which is theirs to reap: nothing breaks."""
    (tmp_path / "slow_preload.py").write_text("import subprocess, time\nhelper = subprocess.Popen(['true'])\n"
                                              "time.sleep(3)\nprint('a stray line')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    own = ForkServer(tmp_path / "fork-server.log", env=env, preload=("slow_preload",))
    monkeypatch.setattr(fork_server, "SPAWN_TIMEOUT_S", 1.0)
    with pytest.raises(ForkServerError, match="did not answer a spawn within 1s"):
        own.spawn(waiting_worker(tmp_path), log=tmp_path / "abandoned.log", append=False)
    monkeypatch.setattr(fork_server, "SPAWN_TIMEOUT_S", 60.0)
    command = ["stats", "--config", str(tmp_path / "missing.toml")]
    child = own.spawn(command, log=tmp_path / "stats.log", append=False)
    assert child.wait(timeout=30) == 1
    assert own.spawn(command, log=tmp_path / "stats.log", append=True).wait(timeout=30) == 1  # it serves on
    children = Path(f"/proc/{own.pid}/task/{own.pid}/children")
    deadline = time.monotonic() + 10
    while any(alive(int(pid)) for pid in children.read_text().split()):  # the abandoned worker, killed
        assert time.monotonic() < deadline, children.read_text()
        time.sleep(0.05)
    own.close()
    assert "a stray line" in (tmp_path / "fork-server.log").read_text()


def test_a_spawn_to_a_stuck_server_fails_at_once_once_its_socket_is_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = start_server(tmp_path)
    command = ["stats", "--config", str(tmp_path / "missing.toml")]
    assert own.spawn(command, log=tmp_path / "stats.log", append=False).wait(timeout=30) == 1
    os.kill(own.pid, signal.SIGSTOP)  # a debugger, a frozen machine
    monkeypatch.setattr(fork_server, "SPAWN_TIMEOUT_S", 0.001)
    try:
        for _ in range(10_000):
            try:
                own.spawn(command, log=tmp_path / "stats.log", append=True)
            except ForkServerError as exc:
                if "is not reading its spawns" in str(exc):
                    break
                assert "did not answer" in str(exc)
        else:
            pytest.fail("10,000 spawns went into the socket of a stopped server")
    finally:
        os.kill(own.pid, signal.SIGKILL)  # before it forks what it was sent
        os.kill(own.pid, signal.SIGCONT)
        own.close()


@pytest.mark.parametrize(("outcome", "status", "printed"), [
    (lambda: None, 0, ""),
    (lambda: 3, 3, ""),
    (lambda: sys.exit(), 0, ""),
    (lambda: sys.exit(4), 4, ""),
    (lambda: sys.exit("cannot go on"), 1, "cannot go on"),
    (lambda: 1 / 0, 1, "ZeroDivisionError"),
])
def test_a_child_exits_with_the_status_the_interpreter_would_give(
    outcome: Callable[[], object], status: int, printed: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "main", lambda argv: outcome())
    assert fork_server._run([]) == status
    assert printed in capsys.readouterr().err


def test_a_child_draws_fresh_seeds_rather_than_the_servers() -> None:
    before = torch.initial_seed()
    fork_server._reseed()
    assert torch.initial_seed() != before


def test_a_handle_dropped_unwaited_closes_its_pidfd(server: ForkServer, tmp_path: Path) -> None:
    child = server.spawn(["stats", "--config", str(tmp_path / "missing.toml")], log=tmp_path / "stats.log",
                         append=False)
    pidfd = child.pidfd
    assert is_pidfd(pidfd)
    del child
    gc.collect()
    assert not is_pidfd(pidfd)


def is_pidfd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
    except FileNotFoundError:
        return False


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
