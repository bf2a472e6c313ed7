"""A local cluster of real processes: the daemon plus N workers per role, on this machine.

Used by the demo, the benchmark and the end-to-end tests; the benchmark can swap the workers
for one process of zero-work protocol peers (orchestrator/instant_workers.py). Workers are forked
from a server that has imported their runtime once (orchestrator/fork_server.py), except those
whose model sits on an accelerator; the daemon is started as a process of its own. All of
them end with the cluster's process, however it ends (orchestrator/parent_death.py). Each
process logs to its own file; every wait has a deadline and a failure names the process and
its log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from orchestrator.config import Config, load_config
from orchestrator.control_client import Control
from orchestrator.fork_server import ForkedProcess, ForkServer, ForkServerError
from orchestrator.parent_death import PARENT_ENV
from transfer.protocol import Role, Stats

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_LAYOUT: dict[Role, int] = {"encoder": 1, "denoiser": 2, "decoder": 1}
KILL_WAIT_S = 10.0  # for a killed process to be reaped


class ClusterError(RuntimeError):
    pass


def ipc_config(shipped: str, folder: Path, name: str, edit: Callable[[dict], object]) -> Path:
    """configs/``shipped`` with its endpoints on ipc:// paths under ``folder`` (prefixed ``name``:
    nothing else listening can collide with them), changed by ``edit`` (given the config as
    plain dicts), written to ``folder/<name>.toml``."""
    raw = msgspec.to_builtins(load_config(CONFIGS / shipped))
    raw["daemon"].update(client_endpoint=f"ipc://{folder}/{name}-client",
                         control_endpoint=f"ipc://{folder}/{name}-control",
                         worker_endpoint=f"ipc://{folder}/{name}-workers")
    edit(raw)
    path = folder / f"{name}.toml"
    path.write_bytes(msgspec.toml.encode(raw))
    return path


def on_accelerator(cfg: Config) -> bool:
    """Whether a worker of ``cfg`` puts its model on a GPU (or another accelerator). Such a
    worker is started as a process of its own, never forked: torch refuses CUDA in a fork of a
    process whose torch has touched the driver, and the fork server's imports (torch,
    diffusers, transformers) do (measured on an H200: every forked worker on ``cuda`` stopped
    with "Cannot re-initialize CUDA in forked subprocess")."""
    return cfg.model.kind == "diffusers" and cfg.model.diffusers.device.split(":")[0] != "cpu"


def all_free(stats: Stats) -> bool:
    """Every slot and preallocated slot free, nothing in flight anywhere."""
    return (
        all(i.slots_free == i.slots_total and i.prealloc_free == i.prealloc_total for i in stats.instances)
        and stats.handoffs_in_flight == 0
        and stats.handoffs_held == 0
        and not stats.requests_by_state
        and not any(stats.queue_depths.values())
    )


class LocalCluster:
    """Start with ``with LocalCluster(path) as cluster:``; stops everything on exit."""

    def __init__(self, config_path: Path, *, layout: dict[Role, int] | None = None, log_dir: Path,
                 instant: bool = False, forks: ForkServer | None = None) -> None:
        self.config_path = Path(config_path)
        self.config: Config = load_config(self.config_path)
        self.layout = layout or DEFAULT_LAYOUT
        self.instant = instant  # one process of zero-work protocol peers instead of real workers
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.daemon: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen | ForkedProcess] = {}
        # A fork server given is shared with other clusters (the test suite's); one started
        # here, at the first worker, is this cluster's to close.
        self._forks = forks
        self._own_forks: ForkServer | None = None
        self._spawned: set[str] = set()
        self.control = Control(self.config.daemon.control_endpoint)

    @property
    def client_endpoint(self) -> str:
        """Where clients connect: the daemon's client socket."""
        return self.config.daemon.client_endpoint

    def _log_path(self, name: str) -> tuple[Path, bool]:
        """Process ``name``'s log, and whether to append to it: a process started again under
        the same name (a restart) appends, so its log keeps the story; a first start replaces
        whatever an earlier cluster left there."""
        append = name in self._spawned
        self._spawned.add(name)
        return self.log_dir / f"{name}.log", append

    def _spawn(self, name: str, *args: str, config_path: Path | None = None) -> subprocess.Popen:
        path, append = self._log_path(name)
        log = open(path, "ab" if append else "wb")  # lives as long as the process
        try:
            config = str(config_path or self.config_path)
            # Its own session (a Ctrl-C meant for the caller does not reach it), but not its
            # own life: it ends with the caller (SIGTERM, the daemon's drain), however that ends.
            env = {**self._env, PARENT_ENV: str(os.getpid())}
            return subprocess.Popen([sys.executable, "-m", "orchestrator", *args, "--config", config],
                                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        finally:
            log.close()

    def _fork_server(self) -> ForkServer:
        if self._forks is None:
            diffusers = ("orchestrator.stages.diffusion",) if self.config.model.kind == "diffusers" else ()
            self._forks = self._own_forks = ForkServer(self.log_dir / "fork-server.log", env=self._env,
                                                       preload=diffusers)
        return self._forks

    def log_of(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def start(self, *, timeout_s: float = 120.0) -> None:
        self.start_daemon()
        if self.instant:
            self.workers["instant"] = self._spawn("instant", "instant-workers", *(
                f"--{role}s={count}" for role, count in self.layout.items()))
        else:
            for role, count in self.layout.items():
                for i in range(count):
                    self.start_worker(role, i)
        self.wait_registered(sum(self.layout.values()), timeout_s=timeout_s)

    def start_daemon(self) -> None:
        """Start the daemon (again, after it stopped: running workers rejoin it)."""
        self.daemon = self._spawn("daemon", "serve")

    def start_worker(self, role: Role, index: int, *, config_path: Path | None = None,
                     name: str | None = None) -> ForkedProcess | subprocess.Popen:
        """Start worker ``<role><index>`` (its key and log name; its ``--name`` too, unless
        ``name`` is given), with its own config file if given (else the cluster's)."""
        key = f"{role}{index}"
        argv = ["worker", "--role", role, "--name", name or key]
        if on_accelerator(load_config(config_path) if config_path else self.config):
            proc = self._spawn(key, *argv, config_path=config_path)
        else:
            log, append = self._log_path(key)
            proc = self._fork_server().spawn([*argv, "--config", str(config_path or self.config_path)],
                                             log=log, append=append)
        self.workers[key] = proc
        return proc

    def wait_registered(self, count: int, *, timeout_s: float) -> Stats:
        """Wait for ``count`` workers to be registered and offered work: each is a suspect
        until its Probe reaches it, and a request submitted before then passes it by."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            try:
                stats = self.control.stats()
                if sum(not i.suspect for i in stats.instances) >= count:
                    return stats
            except (TimeoutError, ConnectionError):  # the daemon is not up yet
                pass
            if time.monotonic() > deadline:
                raise ClusterError(f"{count} workers did not register (and take work) within {timeout_s}s; "
                                   f"logs in {self.log_dir}")
            time.sleep(0.1)

    def _check_alive(self) -> None:
        for name, proc in [("daemon", self.daemon), *self.workers.items()]:
            if proc is not None and proc.poll() is not None:
                # Its last line says why (process.failed or process.crashed); the log has the rest.
                last = (self.log_of(name).strip().splitlines() or ["(no output)"])[-1]
                raise ClusterError(f"{name} exited with {proc.returncode} (log: {self.log_dir / name}.log): {last}")

    def stop_daemon(self, *, timeout_s: float = 30.0) -> int:
        """SIGTERM the daemon and wait for it to drain and exit; returns its exit code."""
        assert self.daemon is not None
        codes: dict[str, int] = {}
        if self._terminate({"daemon": self.daemon}, timeout_s, codes, []):
            raise ClusterError(f"the daemon did not exit within {timeout_s}s of SIGTERM; killed")
        return codes["daemon"]

    def stop(self, *, timeout_s: float = 30.0) -> dict[str, int]:
        """Stop the daemon (it drains), then the workers; exit codes by process name. Every
        process is stopped, one that outlives ``timeout_s`` after SIGTERM killed, and those
        killed, or whose exit status was lost with their fork server, are named in the
        ``ClusterError`` raised at the end: the workers run in their own sessions, so one left
        behind would outlive the caller."""
        codes: dict[str, int] = {}
        problems: list[str] = []
        killed: list[str] = []
        # The daemon first, so it drains while its workers still serve; the workers together.
        for procs in ({"daemon": self.daemon} if self.daemon else {}, self.workers):
            killed.extend(self._terminate(procs, timeout_s, codes, problems))
        if self._own_forks is not None:
            self._own_forks.close()
            self._forks = self._own_forks = None
        if killed:
            problems.insert(0, f"{', '.join(killed)} did not exit within {timeout_s}s of SIGTERM; killed")
        if problems:
            raise ClusterError("; ".join(problems))
        return codes

    @classmethod
    def _terminate(cls, procs: dict[str, subprocess.Popen | ForkedProcess], timeout_s: float, codes: dict[str, int],
                   problems: list[str]) -> list[str]:
        """SIGTERM ``procs``, wait ``timeout_s`` for them, then kill those left; their exit
        codes into ``codes``; returns the names of those killed. Never a second SIGTERM: to
        the daemon that means "stop at once", cutting its drain short."""
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)  # a no-op if it has ended
        # One deadline for all of them, as for the kills after: waited for one after
        # another, each frozen process (SIGSTOP) added timeout_s of its own to the stop.
        overdue = cls._wait_all(procs, time.monotonic() + timeout_s, codes, problems)
        for proc in overdue.values():
            proc.kill()
        stuck = cls._wait_all(overdue, time.monotonic() + KILL_WAIT_S, codes, problems)
        for name in stuck:  # stuck in the kernel: SIGKILL lands when it leaves
            codes[name] = -signal.SIGKILL
        return [name for name in overdue if name in codes]

    @staticmethod
    def _wait_all(procs: dict[str, subprocess.Popen | ForkedProcess], deadline: float, codes: dict[str, int],
                  problems: list[str]) -> dict[str, subprocess.Popen | ForkedProcess]:
        """Wait for ``procs`` until ``deadline`` (monotonic), their exit codes into ``codes``;
        returns those still running."""
        running = {}
        for name, proc in procs.items():
            try:
                codes[name] = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                running[name] = proc
            except ForkServerError as exc:  # it has ended, but how went with its fork server
                problems.append(f"{name}: {exc}")
        return running

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            with contextlib.suppress(ClusterError):  # what failed to start is the news
                self.stop(timeout_s=10)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.stop()
            return
        with contextlib.suppress(ClusterError):  # the block's own failure is the news
            self.stop()
