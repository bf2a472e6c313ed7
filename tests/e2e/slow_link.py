"""A TCP proxy whose client-to-server direction moves at most a given rate: a worker's slow
link to the daemon, on loopback."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

CHUNK = 64 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlowLink:
    """Listens on ``port``, forwards every connection to ``target_port``; bytes towards the
    target leave at ``bytes_per_s``, per connection, bytes back at full speed."""

    def __init__(self, target_port: int, *, bytes_per_s: float) -> None:
        self.port = free_port()
        self._target = ("127.0.0.1", target_port)
        self._rate = bytes_per_s
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._sockets: list[socket.socket] = []
        self._closed = threading.Event()
        self.forwarded = 0  # bytes moved towards the target, all connections together
        self._count = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]

    def __enter__(self) -> SlowLink:
        self._threads[0].start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._closed.set()
        for sock in [self._listener, *self._sockets]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # never connected, or already shut
            sock.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                inbound, _ = self._listener.accept()
            except OSError:
                return  # closed
            outbound = socket.create_connection(self._target, timeout=5)
            outbound.settimeout(None)
            self._sockets += [inbound, outbound]
            for args in ((inbound, outbound, self._rate), (outbound, inbound, None)):
                thread = threading.Thread(target=self._pump, args=args, daemon=True)
                self._threads.append(thread)
                thread.start()

    def _pump(self, source: socket.socket, sink: socket.socket, rate: float | None) -> None:
        try:
            while data := source.recv(CHUNK):
                sink.sendall(data)
                if rate is not None:
                    with self._count:
                        self.forwarded += len(data)
                    time.sleep(len(data) / rate)
        except OSError:
            pass  # either end closed: the other is shut below
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
