"""Where a worker's work socket listens (real workers and the bench's instant workers)."""

from __future__ import annotations

import tempfile
import uuid

import zmq

from orchestrator.config import WorkerConfig


def bind_work_socket(sock: zmq.Socket, wcfg: WorkerConfig) -> str:
    """Bind a worker's work socket as configured; returns the address the daemon should dial."""
    if wcfg.work_socket == "ipc":
        # Unique per process; ZMQ removes the file when the socket closes.
        address = f"ipc://{tempfile.gettempdir()}/triptych-work-{uuid.uuid4().hex}"
        sock.bind(address)
        return address
    sock.bind(f"tcp://{wcfg.bind_host}:0")
    port = sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    return f"tcp://{wcfg.advertise_host}:{port}"
