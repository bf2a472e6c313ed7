"""A worker's work socket: where it binds, and how a message of the instance key and one or
more orders is taken apart."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import anyio
import pytest
import zmq

from orchestrator.config import Config, WorkerConfig
from orchestrator.work_socket import ORDER_MAX_MESSAGE_BYTES, bind_work_socket, close_work_socket
from orchestrator.worker import WorkerRuntime
from transfer.binding import EndpointUnusable, bind
from transfer.pool import MemoryPool
from transfer.protocol import Abort, encode

KEY = b"k" * 16


@pytest.fixture
def runtime() -> WorkerRuntime:
    """A runtime with a key and a pool holding staged blocks for r1, r2 and r3 (no sockets, no engine)."""
    worker = WorkerRuntime("encoder", Config(), name="orders-test", engine=object())  # type: ignore[arg-type]
    worker._key = KEY
    worker._use_pool(pool := MemoryPool(1 << 16))
    assert worker._memory is not None
    for rid in ("r1", "r2", "r3"):
        block = pool.try_alloc(1000)
        assert block is not None
        worker._memory._staged[rid] = block
    return worker


def staged(worker: WorkerRuntime) -> set[str]:
    assert worker._memory is not None
    return {rid for rid in ("r1", "r2", "r3") if worker._memory.holds_output(rid)}


async def test_every_order_of_a_message_is_handled_and_a_bad_one_skipped(runtime: WorkerRuntime) -> None:
    async with anyio.create_task_group() as tg:
        runtime._on_orders([KEY, encode(Abort(request_id="r1")), b"\xc1 not msgpack", encode(Abort(request_id="r3"))],
                           tg)
    assert staged(runtime) == {"r2"}  # r1 and r3 aborted: their blocks are free
    assert runtime._pool is not None and runtime._pool.allocated_blocks == 1


@pytest.mark.parametrize("parts", [[b"w" * 16, encode(Abort(request_id="r1"))], [KEY], []],
                         ids=["wrong key", "key without orders", "empty"])
async def test_a_message_without_the_key_and_an_order_does_nothing(runtime: WorkerRuntime, parts: list[bytes]) -> None:
    async with anyio.create_task_group() as tg:
        runtime._on_orders(parts, tg)
    assert staged(runtime) == {"r1", "r2", "r3"}


@pytest.mark.parametrize(("wcfg", "dialed"), [
    (WorkerConfig(work_socket="tcp", advertise_host="127.0.0.1"), "tcp://127.0.0.1:"),
    (WorkerConfig(work_socket="ipc"), "ipc://"),
    # The daemon dials only IP addresses (a name would be looked up on its I/O thread, where
    # a slow DNS server stalls every socket it has): a worker looks its advertise_host up.
    (WorkerConfig(work_socket="tcp", advertise_host="localhost"), "tcp://127.0.0.1:"),
], ids=["tcp", "ipc", "tcp by name"])
def test_the_work_socket_binds_where_it_says_and_the_daemon_can_dial_it(wcfg: WorkerConfig, dialed: str) -> None:
    ctx = zmq.Context()
    try:
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        address = bind_work_socket(pull, wcfg)
        assert address.startswith(dialed)
        push.connect(address)
        push.send(b"order")
        assert pull.poll(5000) and pull.recv() == b"order"
    finally:
        ctx.destroy(linger=0)


def test_the_work_socket_drops_a_sender_of_an_oversized_frame_unread() -> None:
    ctx = zmq.Context()
    try:
        pull, flood, daemon = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
        address = bind_work_socket(pull, WorkerConfig(work_socket="ipc"))
        flood.connect(address)
        flood.send(b"x" * (ORDER_MAX_MESSAGE_BYTES + 1))
        daemon.connect(address)
        daemon.send(b"order")
        assert pull.poll(5000) and pull.recv() == b"order"
        assert not pull.poll(500)  # the oversized frame never arrives
    finally:
        ctx.destroy(linger=0)


def test_closing_an_ipc_work_socket_removes_its_file() -> None:
    """ZMQ leaves the file behind: one more in the temp directory for every worker that ran."""
    ctx = zmq.Context()
    try:
        pull = ctx.socket(zmq.PULL)
        address = bind_work_socket(pull, WorkerConfig(work_socket="ipc"))
        path = Path(address.removeprefix("ipc://"))
        assert path.exists()
        close_work_socket(pull, address)
        assert not path.exists()
        close_work_socket(ctx.socket(zmq.PULL), None)  # never bound: nothing to remove
    finally:
        ctx.destroy(linger=0)


def test_an_address_the_work_socket_cannot_bind_is_named() -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    try:
        with pytest.raises(EndpointUnusable, match=r"tcp://192\.0\.2\.1:0"):  # not this host's
            bind_work_socket(pull, WorkerConfig(bind_host="192.0.2.1"))
    finally:
        pull.close(linger=0)
        ctx.destroy(linger=0)


def test_a_host_that_names_nothing_here_is_said_plainly() -> None:
    """ZMQ's own word for it is "No such device"."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    try:
        with pytest.raises(EndpointUnusable, match=r"tcp://no-such-host\.invalid:28555 \(no address or interface of "
                                                   r"this host by that name\)$"):
            bind(router, "tcp://no-such-host.invalid:28555")
    finally:
        router.close(linger=0)
        ctx.destroy(linger=0)


def test_a_killed_workers_socket_file_is_removed_by_the_next_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a file whose worker's pid is gone and on which nothing listens: never a live
    worker's, never one that is not a work socket's; and what cannot be judged or removed
    is left without stopping the worker's start."""
    with tempfile.TemporaryDirectory(dir="/tmp") as short:  # under the 108 bytes of a socket path
        directory = Path(short)
        gone = subprocess.Popen(["true"])
        gone.wait()

        def socket_file(pid: int | str, *, listening: bool = False) -> tuple[Path, socket.socket]:
            path = directory / f"triptych-work-{pid}-{uuid.uuid4().hex}"
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(path))
            if listening:
                sock.listen()
            else:
                sock.close()  # as a SIGKILL leaves it: the file, no listener
            return path, sock

        killed, _ = socket_file(gone.pid)
        alive, _ = socket_file(os.getpid())  # a worker still running (between bind and listen)
        other_namespace, listener = socket_file(gone.pid, listening=True)  # its pid is not ours to see
        stranger, _ = socket_file("x")
        past_any_pid, _ = socket_file(9_999_999_999)
        a_directory = directory / f"triptych-work-{gone.pid}-{uuid.uuid4().hex}"
        a_directory.mkdir()  # cannot be unlinked: left, and the worker starts all the same
        monkeypatch.setattr(tempfile, "tempdir", short)
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        try:
            address = bind_work_socket(pull, WorkerConfig(work_socket="ipc"))
        finally:
            listener.close()
            pull.close(linger=0)
            ctx.destroy(linger=0)
        assert not killed.exists()
        assert alive.exists() and other_namespace.exists() and stranger.exists()
        assert past_any_pid.exists() and a_directory.exists()
        assert address.startswith(f"ipc://{short}/triptych-work-{os.getpid()}-")
