"""Worker processes forked from one warm process that has already imported the worker runtime.

Most of a worker's start is ``import torch`` (~2 s of CPU). A local cluster paid it once per
worker, all at once, on every start and restart: on a 2-core machine a cluster of four took
~5 s to come up. The fork server pays it once. Each worker is a fork of it, in a session of its
own, writing to its own log, running exactly what ``python -m orchestrator worker …`` runs.
Only imports are shared: the server opens no socket, creates no engine and runs no tensor op
before it forks, so a child starts as clean as a fresh interpreter would (Mooncake, which
starts threads when imported, is imported by each child itself). Children get the server's
environment, and the random generators torch and numpy seeded at import are seeded again.

The parent and the server talk over a Unix SEQPACKET socket, one msgspec message per packet:
``Spawn`` in; ``Spawned`` back with a pidfd of the child, by which the parent signals that
process and no other, even once its pid is free again; ``Exited`` whenever a child ends, since
only the server can reap its children and read their exit status. Every message names its
spawn by an id of the parent's, never by pid: a pid is reused once its process is reaped.
A child gets SIGTERM when the server ends (``PR_SET_PDEATHSIG``), so a server that dies, or
whose parent dies, leaves no worker behind.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import threading
import traceback
import weakref
from pathlib import Path
from typing import assert_never

import msgspec
import setproctitle

from orchestrator.parent_death import end_with_parent

SPAWN_TIMEOUT_S = 60.0  # the first spawn waits for the server's own imports
CLOSE_TIMEOUT_S = 10.0
MAX_MESSAGE = 1 << 20  # a Spawn is a command line and two paths


class Spawn(msgspec.Struct, tag=True):
    id: int
    argv: list[str]  # the ``orchestrator`` command line, as after ``python -m orchestrator``
    log: str  # the child's stdout and stderr
    append: bool  # a restart keeps the log of the process it replaces


class Spawned(msgspec.Struct, tag=True):
    id: int
    pid: int  # the child's pidfd travels with this message


class SpawnFailed(msgspec.Struct, tag=True):
    id: int
    error: str


class Exited(msgspec.Struct, tag=True):
    id: int
    code: int  # as ``Popen.returncode``: negative for the signal that killed it


Event = Spawned | SpawnFailed | Exited


class ForkServerError(RuntimeError):
    pass


class ForkServer:
    """The parent's side: starts the server, spawns workers through it, learns how they end."""

    def __init__(self, log_path: Path, *, env: dict[str, str], preload: tuple[str, ...] = ()) -> None:
        self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The server's own output, anything its imports print included, goes to its log: its
        # stdout is not the channel, so a stray print cannot break the protocol.
        with theirs, open(log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "orchestrator.fork_server", str(theirs.fileno()), *preload],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                pass_fds=(theirs.fileno(),), start_new_session=True)
        self.log_path = log_path
        self.pid = self._proc.pid  # the server's
        self._ids = itertools.count()
        self._changed = threading.Condition()
        self._answers: dict[int, tuple[int, int] | str] = {}  # spawn id -> (pid, pidfd) or why it failed
        self._abandoned: set[int] = set()  # spawns given up on: their child, should one come, is killed
        self._codes: dict[int, int] = {}  # spawn id -> exit code
        self._closed = False
        self._gone = False  # the server's end closed: no more news of any child
        self._reader = threading.Thread(target=self._read, name="fork-server", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        decoder = msgspec.msgpack.Decoder(Event)
        try:
            while True:
                try:
                    data, fds, _, _ = socket.recv_fds(self._socket, MAX_MESSAGE, 1)
                except ConnectionResetError:  # it ended with spawns unread
                    return
                if not data:
                    return
                self._heard(decoder.decode(data), fds)
        finally:
            with self._changed:
                self._gone = True
                self._changed.notify_all()

    def _heard(self, event: Event, fds: list[int]) -> None:
        for fd in fds:
            os.set_inheritable(fd, False)  # SCM_RIGHTS gives none the close-on-exec flag
        with self._changed:
            match event:
                case Spawned(id=spawn_id) if spawn_id in self._abandoned:
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(fds[0], signal.SIGKILL)
                    os.close(fds[0])
                case Spawned(id=spawn_id, pid=pid):
                    self._answers[spawn_id] = (pid, fds[0])
                case SpawnFailed(id=spawn_id) | Exited(id=spawn_id) if spawn_id in self._abandoned:
                    self._abandoned.discard(spawn_id)  # its last word
                case SpawnFailed(id=spawn_id, error=error):
                    self._answers[spawn_id] = error
                case Exited(id=spawn_id, code=code):
                    self._codes[spawn_id] = code
                case _:
                    assert_never(event)
            self._changed.notify_all()

    def spawn(self, argv: list[str], *, log: Path, append: bool) -> ForkedProcess:
        """Fork a child running ``python -m orchestrator <argv>``; its output goes to ``log``."""
        with self._changed:
            if self._closed:
                raise self._failure("is closed")
            spawn_id = next(self._ids)
        try:  # never waiting: the server reads as fast as spawns come, or is stuck
            self._socket.send(msgspec.msgpack.encode(Spawn(spawn_id, argv, str(log), append)), socket.MSG_DONTWAIT)
        except BlockingIOError:
            raise self._failure("is not reading its spawns") from None
        except OSError:
            raise self._failure("is gone") from None
        with self._changed:
            if not self._changed.wait_for(lambda: spawn_id in self._answers or self._gone, timeout=SPAWN_TIMEOUT_S):
                self._abandoned.add(spawn_id)
                raise self._failure(f"did not answer a spawn within {SPAWN_TIMEOUT_S:.0f}s")
            answer = self._answers.pop(spawn_id, None)
        if answer is None:
            raise self._failure("exited")
        if isinstance(answer, str):
            raise self._failure(f"could not fork: {answer}")
        pid, pidfd = answer
        return ForkedProcess(self, spawn_id, pid, pidfd)

    def _failure(self, what: str) -> ForkServerError:
        return ForkServerError(f"the worker fork server {what} (log: {self.log_path})")

    def wait(self, child: ForkedProcess, timeout_s: float | None) -> int | None:
        """``child``'s exit code, once it has one, waiting up to ``timeout_s`` (0: not at all).
        A child still running when the server ended can only be watched through its pidfd;
        if it has ended its exit status is lost, and that raises."""
        with self._changed:
            self._changed.wait_for(lambda: child.spawn_id in self._codes or self._gone, timeout=timeout_s)
            if child.spawn_id in self._codes:
                return self._codes.pop(child.spawn_id)
            if not self._gone:
                return None
        ended = select.poll()
        ended.register(child.pidfd, select.POLLIN)  # readable once it has ended
        if ended.poll(None if timeout_s is None else timeout_s * 1000):
            raise self._failure(f"exited before worker {child.pid} did: its exit status is lost")
        return None

    def _forget(self, spawn_id: int, pidfd: int) -> None:
        """A child's handle is done with: its pidfd closes, an exit code left unread goes."""
        os.close(pidfd)
        with self._changed:
            self._codes.pop(spawn_id, None)

    def close(self) -> None:
        """Stop the server. Its children get SIGTERM: stop them first, to learn how they end."""
        with self._changed:
            self._closed = True
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_WR)  # end of input: the server exits
        try:
            self._proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=CLOSE_TIMEOUT_S)
        self._socket.close()


class ForkedProcess:
    """A worker forked by the server, used as the ``subprocess.Popen`` it replaces."""

    def __init__(self, server: ForkServer, spawn_id: int, pid: int, pidfd: int) -> None:
        self._server = server
        self.spawn_id = spawn_id
        self.pid = pid
        self.pidfd = pidfd
        self.returncode: int | None = None
        self._lost: ForkServerError | None = None  # it ended after its server: how is unknown
        # Its pidfd closes when its end is known, or when the handle goes unwaited.
        self._release = weakref.finalize(self, server._forget, spawn_id, pidfd)

    def poll(self) -> int | None:
        self._learn(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._learn(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        return self.returncode

    def _learn(self, timeout_s: float | None) -> None:
        """Wait up to ``timeout_s`` to learn how it ended; raises if that is lost."""
        if self.returncode is None and self._lost is None:
            try:
                self.returncode = self._server.wait(self, timeout_s)
            except ForkServerError as exc:
                self._lost = exc
            if self.returncode is not None or self._lost is not None:
                self._release()
        if self._lost is not None:
            raise self._lost

    def send_signal(self, sig: int) -> None:
        if self._release.alive:  # the pidfd names this process only: no reused pid is hit
            with contextlib.suppress(ProcessLookupError):  # ended; its exit is on its way
                signal.pidfd_send_signal(self.pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _serve(channel: socket.socket, preload: list[str]) -> None:
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
    decoder = msgspec.msgpack.Decoder(Spawn)
    selector = selectors.DefaultSelector()
    selector.register(channel, selectors.EVENT_READ)
    selector.register(woken_r, selectors.EVENT_READ)
    children: dict[int, int] = {}  # pid -> spawn id, until reaped
    while True:
        for key, _ in selector.select():
            if key.fileobj == woken_r:
                os.read(woken_r, 4096)
                _report_exits(channel, children)
                continue
            data = channel.recv(MAX_MESSAGE)
            if not data:  # the parent closed us
                return
            spawn = decoder.decode(data)
            try:
                pid = _fork(spawn, (selector, channel, woken_r, woken_w))
            except OSError as exc:  # EAGAIN, ENOMEM: this spawn fails, the server goes on
                channel.send(msgspec.msgpack.encode(SpawnFailed(spawn.id, str(exc))))
                continue
            children[pid] = spawn.id
            # Opened before this loop can reap the child: the pidfd is of this very process.
            pidfd = os.pidfd_open(pid)
            socket.send_fds(channel, [msgspec.msgpack.encode(Spawned(spawn.id, pid))], [pidfd])
            os.close(pidfd)


def _report_exits(channel: socket.socket, children: dict[int, int]) -> None:
    # Each of its own by pid: a child some imported library started is that library's to reap.
    for pid in list(children):
        reaped, status = os.waitpid(pid, os.WNOHANG)
        if reaped:
            channel.send(msgspec.msgpack.encode(Exited(children.pop(pid), os.waitstatus_to_exitcode(status))))


def _fork(spawn: Spawn, plumbing: tuple[selectors.BaseSelector, socket.socket, int, int]) -> int:
    server = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the child: shed the server's plumbing, then be `python -m orchestrator <argv>`
        os.setsid()
        if not end_with_parent(server):  # it ended already
            return 1
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        selector, channel, *fds = plumbing
        selector.close()
        channel.close()
        for fd in fds:
            os.close(fd)
        log = os.open(spawn.log, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if spawn.append else os.O_TRUNC), 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((devnull, 0), (log, 1), (log, 2)):
            os.dup2(fd, target)
        os.close(log)
        os.close(devnull)
        _reseed()
        # What ``ps`` and ``pgrep -f`` show: the command it runs, not the server's.
        setproctitle.setproctitle(shlex.join([sys.executable, "-m", "orchestrator", *spawn.argv]))
        sys.argv = [sys.argv[0], *spawn.argv]
        code = _run(spawn.argv)
    except BaseException:  # before the command ran: it goes to the server's log
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code & 0xFF)


def _reseed() -> None:
    """Fresh seeds, as a fresh interpreter would draw (Python's ``random`` reseeds itself)."""
    import torch

    torch.seed()
    if (numpy := sys.modules.get("numpy")) is not None:
        numpy.random.seed()


def _run(argv: list[str]) -> int:
    """``orchestrator.cli.main(argv)``'s exit status, as the interpreter would make it."""
    try:
        from orchestrator.cli import main

        status: object = main(argv)
    except SystemExit as exc:
        status = exc.code
    except BaseException:
        traceback.print_exc()
        return 1
    if status is None:
        return 0
    if isinstance(status, int):
        return status
    print(status, file=sys.stderr)
    return 1


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])), sys.argv[2:])
