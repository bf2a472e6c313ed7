"""Stand-in peers for the control-plane benchmark, each in a process of its own: what the
sockets and the client cost without the daemon, to subtract from what they cost with it.

Kept apart from the benchmark so a stand-in's process imports only ZMQ and the wire protocol.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import zmq

from orchestrator.instant_workers import OUTPUT
from orchestrator.parent_death import end_with_parent
from orchestrator.proc_stats import cpu_seconds
from transfer.protocol import CLIENT_REQUEST, ROLES, Result, StageTiming, encode

ROOT = Path(__file__).resolve().parent.parent
PEER_START_S = 10.0  # a stand-in process starts Python, imports this module (~0.3 s) and binds
ECHO_REPLY_S = 5.0


@contextlib.contextmanager
def stand_in(peer: str, endpoint: str) -> Iterator[subprocess.Popen]:
    """``peer`` (``echo_router`` or ``instant_daemon``) serving ``endpoint`` (ipc://) in a
    process of its own, which ends with this one however it ends; once it has bound."""
    proc = subprocess.Popen([sys.executable, "-c", f"from orchestrator.bench_peers import {peer}; "
                             f"{peer}({endpoint!r}, {os.getpid()})"], cwd=ROOT)
    try:
        deadline = time.monotonic() + PEER_START_S
        while not Path(endpoint.removeprefix("ipc://")).exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {peer} stand-in did not start (its exit code: {proc.poll()})")
            time.sleep(0.05)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _bound_router(endpoint: str, parent: int) -> zmq.Socket | None:
    if not end_with_parent(parent):
        return None
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(endpoint)
    return sock


def echo_router(endpoint: str, parent: int) -> None:
    """A do-nothing ROUTER answering every message at once: the sockets' floor."""
    if (sock := _bound_router(endpoint, parent)) is not None:
        while True:
            identity, empty, _ = sock.recv_multipart()
            sock.send_multipart([identity, empty, b"\x00"])


def instant_daemon(endpoint: str, parent: int) -> None:
    """Answers every Submit at once with the Result a request through the instant workers
    gets (their 64-byte output, three stage timings): the client's and the sockets' share."""
    if (sock := _bound_router(endpoint, parent)) is None:
        return
    stages = [StageTiming(role=role, instance=f"{role}-1", queued_ms=0.0, compute_ms=0.0) for role in ROLES]
    output = bytes(OUTPUT.nbytes)
    while True:
        identity, empty, body = sock.recv_multipart()
        result = Result(request_id=CLIENT_REQUEST.decode(body).request_id, outputs=[OUTPUT], stages=stages,
                        total_ms=0.0)
        sock.send_multipart([identity, empty, encode(result), output])


def echo_floor(endpoint: str, n: int, concurrency: int) -> tuple[float, float]:
    """p50 latency (ms) and the echo process's CPU per round trip (ms), from another process."""
    with stand_in("echo_router", endpoint) as proc, zmq.Context.instance().socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)

        def answer() -> None:
            try:
                sock.recv_multipart()
            except zmq.Again:
                raise TimeoutError(f"the do-nothing ROUTER at {endpoint} did not answer in time "
                                   f"(its exit code: {proc.poll()})") from None

        # Receive timeouts, not a poll per reply: the floor must not pay for the check.
        sock.setsockopt(zmq.RCVTIMEO, int(ECHO_REPLY_S * 1000))
        sock.send_multipart([b"", b"warm"])
        answer()
        times = []
        cpu0 = cpu_seconds(proc.pid)
        for _ in range(n // concurrency):
            t0 = time.perf_counter()
            for _ in range(concurrency):
                sock.send_multipart([b"", b"ping"])
            for _ in range(concurrency):
                answer()
            times.append(time.perf_counter() - t0)
        cpu = cpu_seconds(proc.pid) - cpu0
    return statistics.median(times) * 1000, cpu / (n // concurrency * concurrency) * 1000
