"""Worker processes forked from one warm process that has already imported the worker runtime.

Most of a worker's start is ``import torch`` (~2 s of CPU). A local cluster paid it once per
worker, all at once, on every start and restart: on a 2-core machine a cluster of four took
~5 s to come up. The fork server pays it once. Each worker is a fork of it, in a session of its
own, writing to its own log, running exactly what ``python -m orchestrator worker …`` runs.
Only imports are shared: the server opens no socket, creates no engine and runs no tensor op
before it forks, so a child starts as clean as a fresh interpreter would (Mooncake, which
starts threads when imported, is imported by each child itself).

The parent talks to the server over its stdin and stdout, one JSON message per line: ``Spawn``
in, ``Spawned`` back; ``Exited`` whenever a child ends, since only the server can reap its
children and read their exit status.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import IO

import msgspec

SPAWN_TIMEOUT_S = 60.0  # the first spawn waits for the server's own imports
CLOSE_TIMEOUT_S = 10.0


class Spawn(msgspec.Struct, tag=True):
    argv: list[str]  # the ``orchestrator`` command line, as after ``python -m orchestrator``
    log: str  # the child's stdout and stderr
    append: bool  # a restart keeps the log of the process it replaces


class Spawned(msgspec.Struct, tag=True):
    pid: int


class Exited(msgspec.Struct, tag=True):
    pid: int
    code: int  # as ``Popen.returncode``: negative for the signal that killed it


Event = Spawned | Exited


class ForkServerError(RuntimeError):
    pass


class ForkServer:
    """The parent's side: starts the server, spawns workers through it, learns how they end."""

    def __init__(self, log_path: Path, *, env: dict[str, str], preload: tuple[str, ...] = ()) -> None:
        with open(log_path, "ab") as log:
            self._proc = subprocess.Popen([sys.executable, "-m", "orchestrator.fork_server", *preload],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                          start_new_session=True)
        self.log_path = log_path
        self._spawn_lock = threading.Lock()  # one Spawn in flight: its Spawned is the next one back
        self._changed = threading.Condition()
        self._spawned: list[int] = []
        self._codes: dict[int, int] = {}
        self._gone = False  # the server's stdout closed: no more news of any child
        self._reader = threading.Thread(target=self._read, name="fork-server", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        decoder = msgspec.json.Decoder(Event)
        for line in self._proc.stdout:
            event = decoder.decode(line)
            with self._changed:
                if isinstance(event, Spawned):
                    self._spawned.append(event.pid)
                else:
                    self._codes[event.pid] = event.code
                self._changed.notify_all()
        with self._changed:
            self._gone = True
            self._changed.notify_all()

    def spawn(self, argv: list[str], *, log: Path, append: bool) -> ForkedProcess:
        """Fork a child running ``python -m orchestrator <argv>``; its output goes to ``log``."""
        assert self._proc.stdin is not None
        with self._spawn_lock:
            if self._proc.stdin.closed:
                raise self._failure("is closed")
            try:
                self._proc.stdin.write(msgspec.json.encode(Spawn(argv, str(log), append)) + b"\n")
                self._proc.stdin.flush()
            except BrokenPipeError:
                raise self._failure("is gone") from None
            with self._changed:
                if not self._changed.wait_for(lambda: self._spawned or self._gone, timeout=SPAWN_TIMEOUT_S):
                    raise self._failure(f"did not answer a spawn within {SPAWN_TIMEOUT_S:.0f}s")
                if not self._spawned:
                    raise self._failure("exited")
                return ForkedProcess(self, self._spawned.pop(0))

    def _failure(self, what: str) -> ForkServerError:
        return ForkServerError(f"the worker fork server {what} (log: {self.log_path})")

    def returncode(self, pid: int) -> int | None:
        with self._changed:
            return self._returncode(pid)

    def _returncode(self, pid: int) -> int | None:
        if pid in self._codes:
            return self._codes[pid]
        if self._gone:  # its children, now the init process's, can no longer be waited for
            raise self._failure(f"exited before worker {pid} did")
        return None

    def wait(self, pid: int, timeout_s: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._codes or self._gone, timeout=timeout_s)
            return self._returncode(pid)

    def close(self) -> None:
        """Stop the server (its children are the caller's to stop first)."""
        if self._proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.close()  # end of input: the server exits
        try:
            self._proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=CLOSE_TIMEOUT_S)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


class ForkedProcess:
    """A worker forked by the server, used as the ``subprocess.Popen`` it replaces."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.wait(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a pid that may have been reused
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _serve(preload: list[str]) -> None:
    """The server: import once, then fork a child per Spawn and report each child's exit."""
    import importlib

    import orchestrator.cli  # noqa: F401  what every worker runs
    import orchestrator.worker  # noqa: F401  torch and the runtime: the import worth sharing

    for module in preload:
        importlib.import_module(module)
    woken_r, woken_w = os.pipe()
    os.set_blocking(woken_w, False)
    signal.set_wakeup_fd(woken_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears of it
    requests = sys.stdin.buffer
    out = sys.stdout.buffer
    decoder = msgspec.json.Decoder(Spawn)
    selector = selectors.DefaultSelector()
    selector.register(requests, selectors.EVENT_READ)
    selector.register(woken_r, selectors.EVENT_READ)
    pending = b""
    while True:
        for key, _ in selector.select():
            if key.fileobj == woken_r:
                os.read(woken_r, 4096)
                _report_exits(out)
                continue
            data = os.read(requests.fileno(), 65536)
            if not data:  # the parent closed us
                return
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                pid = _fork(decoder.decode(line), selector, (woken_r, woken_w))
                out.write(msgspec.json.encode(Spawned(pid)) + b"\n")
                out.flush()


def _report_exits(out: IO[bytes]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        out.write(msgspec.json.encode(Exited(pid, os.waitstatus_to_exitcode(status))) + b"\n")
        out.flush()


def _fork(spawn: Spawn, selector: selectors.BaseSelector, server_fds: tuple[int, int]) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the child: shed the server's plumbing, then be `python -m orchestrator <argv>`
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        selector.close()
        for fd in server_fds:
            os.close(fd)
        log = os.open(spawn.log, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if spawn.append else os.O_TRUNC), 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((devnull, 0), (log, 1), (log, 2)):
            os.dup2(fd, target)
        os.close(log)
        os.close(devnull)
        sys.argv = [sys.argv[0], *spawn.argv]
        from orchestrator.cli import main

        code = main(spawn.argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    _serve(sys.argv[1:])
