"""A fake daemon that floods a client with progress, in a process of its own (as a daemon is:
a thread of the client's process would share its interpreter lock and pause the stream).

It takes one Submit, then sends Progress for it as fast as the client's connection takes
it, with no pause, for ``for_s`` or until its owner closes it; it tells its owner on stdout.
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq

from tests.actors.fake_daemon import router_at
from transfer.protocol import CLIENT_REQUEST, Progress, Submit, encode

# Progress messages sent before it says it floods: past ZMQ's queues on both sides of the
# connection (1,000 messages each).
FLOODING_AFTER = 5_000
ROOT = Path(__file__).resolve().parents[2]


class ProgressFlood:
    """The flooding process at ``endpoint``, while in a ``with``. ``flooding`` is set once
    the stream is well under way, ``ended`` once ``for_s`` has passed (``sent`` says how
    many it sent); after the ``with``, ``heard`` names what the client sent (its type, its
    request id)."""

    def __init__(self, endpoint: str, *, for_s: float = math.inf) -> None:
        self.flooding = threading.Event()
        self.ended = threading.Event()
        self.sent = 0
        self.heard: list[tuple[str, str]] = []
        self._args = [sys.executable, "-m", "tests.actors.progress_flood", endpoint, str(for_s)]

    def __enter__(self) -> ProgressFlood:
        self._process = subprocess.Popen(self._args, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True)
        self._reader = threading.Thread(target=self._read, name="progress-flood-reader")
        self._reader.start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()  # its cue to stop
        self._process.wait(timeout=10)
        self._reader.join(timeout=10)
        assert self._process.stdout is not None
        self._process.stdout.close()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            match line.split():
                case ["flooding"]:
                    self.flooding.set()
                case ["ended", sent]:
                    self.sent = int(sent)
                    self.ended.set()
                case ["heard", kind, request_id]:
                    self.heard.append((kind, request_id))


def _flood(endpoint: str, for_s: float) -> None:
    ctx = zmq.Context()
    daemon = router_at(ctx, endpoint)
    poller = zmq.Poller()
    poller.register(daemon, zmq.POLLIN)
    poller.register(sys.stdin, zmq.POLLIN)  # readable once the owner closes it
    identity, progress, until, sent, ended = b"", b"", math.inf, 0, False
    while True:
        flooding = bool(identity) and not ended
        ready = dict(poller.poll(0 if flooding else 10))
        if sys.stdin.fileno() in ready:
            break
        if daemon in ready:
            frames = daemon.recv_multipart()
            msg = CLIENT_REQUEST.decode(frames[-1])
            print("heard", type(msg).__name__, msg.request_id, flush=True)
            if isinstance(msg, Submit) and not identity:
                identity, until = frames[0], time.monotonic() + for_s
                progress = encode(Progress(request_id=msg.request_id, state="denoising", elapsed_ms=1.0))
        if not flooding:
            continue
        if time.monotonic() > until:
            print("ended", sent, flush=True)
            ended = True
            continue
        try:
            daemon.send_multipart([identity, b"", progress], zmq.NOBLOCK)
        except zmq.Again:  # the connection's queue is full: the client reads slower
            time.sleep(0.0002)
            continue
        sent += 1
        if sent == FLOODING_AFTER:
            print("flooding", flush=True)
    daemon.close()
    ctx.term()


if __name__ == "__main__":
    _flood(sys.argv[1], float(sys.argv[2]))
