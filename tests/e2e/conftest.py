"""Real daemon, real worker processes, real sockets, real Mooncake transfers."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from orchestrator.client import Client, Reply
from orchestrator.cluster import ClusterError, LocalCluster
from orchestrator.config import Config, load_config
from orchestrator.fork_server import ForkServer
from transfer.protocol import Role, Stats

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def cluster_config(tmp: Path, **sections: dict) -> tuple[Path, Config]:
    """configs/test.toml with ipc:// endpoints under ``tmp`` and ``sections`` overriding keys."""
    cfg = load_config(CONFIGS / "test.toml")
    daemon = msgspec.structs.replace(cfg.daemon, client_endpoint=f"ipc://{tmp}/client",
                                     control_endpoint=f"ipc://{tmp}/control", worker_endpoint=f"ipc://{tmp}/workers")
    cfg = msgspec.structs.replace(cfg, daemon=daemon)
    path = tmp / "cluster.toml"
    _write_with(path, msgspec.to_builtins(cfg), sections)
    return path, load_config(path)


def config_variant(cluster: LocalCluster, path: Path, section: str, values: dict) -> Path:
    """The cluster's config file with ``values`` set in ``section`` (dotted), written to
    ``path``: a worker started with it joins the same daemon with other settings."""
    _write_with(path, msgspec.toml.decode(cluster.config_path.read_bytes()), {section: values})
    return path


def _write_with(path: Path, raw: dict, sections: dict[str, dict]) -> None:
    """``raw`` (a config as plain dicts) with each dotted section's ``values`` set, as TOML."""
    for section, values in sections.items():
        node = raw
        for key in section.split("."):
            node = node.setdefault(key, {})
        node.update(values)
    path.write_bytes(msgspec.toml.encode(raw))


StartCluster = Callable[..., LocalCluster]


@pytest.fixture
def same_threads_as_workers() -> Iterator[None]:
    """This process computes references at the workers' torch thread count: on CPU the
    count changes reduction order, hence the last bits of a float."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # configs/test.toml: torch_threads = 1 for every role
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def forks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """One fork server for every cluster of the session: each imports torch (and diffusers)
    once in all, not once per worker."""
    server = ForkServer(tmp_path_factory.mktemp("forks") / "fork-server.log",
                        env={**os.environ, "PYTHONUNBUFFERED": "1"}, preload=("orchestrator.stages.diffusion",))
    yield server
    server.close()


@pytest.fixture
def start_cluster(tmp_path_factory: pytest.TempPathFactory, forks: ForkServer) -> Iterator[StartCluster]:
    started: list[LocalCluster] = []

    def start(layout: dict[Role, int] | None = None, *, instant: bool = False, **sections: dict) -> LocalCluster:
        tmp = tmp_path_factory.mktemp("c")  # short: ipc paths are limited to ~100 bytes
        path, _ = cluster_config(tmp, **sections)
        cluster = LocalCluster(path, layout=layout, log_dir=tmp / "logs", instant=instant, forks=forks)
        started.append(cluster)
        cluster.start(timeout_s=120)
        return cluster

    yield start
    failures: list[str] = []
    for cluster in started:  # every cluster stopped, whatever the one before it did
        try:
            cluster.stop(timeout_s=20)
            assert_no_crash(cluster)
        except (ClusterError, AssertionError) as exc:
            failures.append(str(exc))
    assert not failures, failures


def assert_no_crash(cluster: LocalCluster) -> None:
    """No process of ``cluster`` died of a bug: a test that looks only at its own replies
    would not notice a worker that crashed beside them."""
    for log in sorted(cluster.log_dir.glob("*.log")):
        crashed = [line for line in log.read_text(errors="replace").splitlines() if "process.crashed" in line]
        assert not crashed, f"{log.name}: {crashed[0][:2000]}"


def assert_torch_free(pid: int) -> None:
    """Process ``pid`` has not loaded torch: one that never touches a tensor would pay
    190 MiB and seconds of start-up for it (and a daemon, every garbage collection)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "libtorch" not in maps and "libc10" not in maps


def wait_for(cluster: LocalCluster, check: Callable[[Stats], bool], *, timeout_s: float = 10.0) -> Stats:
    """Poll the daemon's stats until ``check`` holds; fail with the last stats otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = cluster.control.stats()
        if check(stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s; last stats: {stats}")
        time.sleep(0.05)


class RawClient(Client):
    """A client that sends what a hand-built one might: any frames at all."""

    def send_raw(self, parts: list[bytes], *, timeout_s: float = 10.0) -> Reply:
        return self._request(parts, timeout_s)
