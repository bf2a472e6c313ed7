"""``Control``: the blocking client of the daemon's control socket (stats, workers, drain).

Its own module, free of torch like ``Rejection``: the commands an operator types
(``triptych stats``, ``workers``, ``drain``) and the Prometheus exporter, which runs beside
the daemon for good, only ever read numbers, and torch would cost each about 2.5 s of CPU
to start and 190 MiB to keep.
"""

from __future__ import annotations

import zmq

from orchestrator.deadlines import poll_ms
from orchestrator.rejection import Rejection
from transfer.protocol import (
    CONTROL_REPLY,
    ControlReply,
    ControlRequest,
    Drain,
    Draining,
    GetStats,
    ListWorkers,
    Rejected,
    Stats,
    Workers,
    encode,
)


class Control:
    """Blocking client for the control socket."""

    def __init__(self, endpoint: str, *, timeout_s: float = 10.0, ctx: zmq.Context | None = None) -> None:
        self.endpoint = endpoint
        self._timeout_ms = poll_ms(timeout_s)
        self._ctx = ctx or zmq.Context.instance()

    def _ask(self, request: ControlRequest) -> ControlReply:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.endpoint)
            sock.send(encode(request))
            if not sock.poll(self._timeout_ms):
                raise TimeoutError(f"no reply from control socket {self.endpoint} within {self._timeout_ms / 1000:.1f}s")
            reply = CONTROL_REPLY.decode(sock.recv())
        finally:
            sock.close(linger=0)
        if isinstance(reply, Rejected):
            raise Rejection(reply)
        return reply

    def stats(self) -> Stats:
        reply = self._ask(GetStats())
        assert isinstance(reply, Stats)
        return reply

    def workers(self) -> Workers:
        reply = self._ask(ListWorkers())
        assert isinstance(reply, Workers)
        return reply

    def drain(self) -> Draining:
        reply = self._ask(Drain())
        assert isinstance(reply, Draining)
        return reply
