"""Where a worker's work socket listens (real workers and the bench's instant workers)."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

import zmq

from orchestrator.config import WorkerConfig
from transfer.binding import bind

# An order frame stays under 150 KiB (its two prompts hold at most 16,384 characters each).
# Anyone who can reach the port can send, and the key is only checked once a message is
# read: a frame over this limit disconnects its sender unread.
ORDER_MAX_MESSAGE_BYTES = 1 << 20


def bind_work_socket(sock: zmq.Socket, wcfg: WorkerConfig) -> str:
    """Bind a worker's work socket as configured; returns the address the daemon should dial."""
    sock.setsockopt(zmq.MAXMSGSIZE, ORDER_MAX_MESSAGE_BYTES)
    if wcfg.work_socket == "ipc":
        # Unique per process; close_work_socket removes the file.
        address = f"ipc://{tempfile.gettempdir()}/triptych-work-{uuid.uuid4().hex}"
        bind(sock, address)
        return address
    bind(sock, f"tcp://{wcfg.bind_host}:0")
    port = sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    return f"tcp://{wcfg.advertise_host}:{port}"


def close_work_socket(sock: zmq.Socket, address: str | None) -> None:
    """Close a socket ``bind_work_socket`` bound at ``address`` (None: it never bound). An
    ipc socket's file is removed: ZMQ leaves it behind, one more in the temp directory per
    worker that ever ran."""
    sock.close(linger=0)
    remove_socket_file(address)


def remove_socket_file(address: str | None) -> None:
    """Remove an ``ipc://`` work socket's file (nothing for tcp, or None)."""
    if address is not None and address.startswith("ipc://"):
        Path(address.removeprefix("ipc://")).unlink(missing_ok=True)
