"""Where a worker's work socket listens (real workers and the bench's instant workers)."""

from __future__ import annotations

import os
import re
import tempfile
import uuid
from pathlib import Path

import zmq

from orchestrator.config import WorkerConfig
from orchestrator.own_addresses import dialable
from transfer.binding import bind, remove_ipc_file, unix_listener_at

# An order frame stays under about 210 KB (two prompts of 16,384 characters, 64 tensor
# headers: the wire bounds all it relays, and tests/unit/test_protocol.py builds the largest).
# Anyone who can reach the port can send, and the key is only checked once a message is
# read: a frame over this limit disconnects its sender unread.
ORDER_MAX_MESSAGE_BYTES = 1 << 20

# An ipc work socket's file: triptych-work-<pid of its worker>-<uuid>.
IPC_FILE = re.compile(r"^triptych-work-(\d{1,10})-[0-9a-f]{32}$")


def bind_work_socket(sock: zmq.Socket, wcfg: WorkerConfig) -> str:
    """Bind a worker's work socket as configured; returns the address the daemon should dial."""
    sock.setsockopt(zmq.MAXMSGSIZE, ORDER_MAX_MESSAGE_BYTES)
    if wcfg.work_socket == "ipc":
        # Unique per process; close_work_socket removes the file, and a later worker the file
        # of one that was killed.
        directory = Path(tempfile.gettempdir())
        remove_dead_socket_files(directory)
        address = f"ipc://{directory}/triptych-work-{os.getpid()}-{uuid.uuid4().hex}"
        bind(sock, address)
        return address
    bind(sock, f"tcp://{wcfg.bind_host}:0")
    port = sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    ip = dialable(wcfg.advertise_host)
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def close_work_socket(sock: zmq.Socket, address: str | None) -> None:
    """Close a socket ``bind_work_socket`` bound at ``address`` (None: it never bound). An
    ipc socket's file is removed: ZMQ leaves it behind, one more in the temp directory per
    worker that ever ran."""
    sock.close(linger=0)
    remove_ipc_file(address)


def remove_dead_socket_files(directory: Path) -> None:
    """Remove the ipc work socket files in ``directory`` left by workers that were killed
    (SIGKILL, a crash): a file whose worker's pid is gone and on which nothing listens.
    Both are asked: a worker binding at this instant is not listening yet, but its pid is
    alive. (Workers in other pid namespaces sharing the directory are judged by the socket
    alone.) Best effort: a file it cannot judge or remove is left, and never stops a start.
    """
    for path in directory.glob("triptych-work-*"):
        named = IPC_FILE.match(path.name)
        if named is None:
            continue
        try:
            if not _process_exists(int(named[1])) and not unix_listener_at(str(path)):
                path.unlink(missing_ok=True)
        except (OSError, OverflowError):
            continue  # another user's, a directory, a pid past the kernel's range


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's
    return True
