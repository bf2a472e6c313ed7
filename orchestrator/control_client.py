"""``Control``: the blocking client of the daemon's control socket (stats, workers, drain).

Its own module, free of torch like ``Rejection``: the commands an operator types
(``triptych stats``, ``workers``, ``drain``) and the Prometheus exporter, which runs beside
the daemon for good, only ever read numbers, and torch would cost each about 2.5 s of CPU
to start and 190 MiB to keep.
"""

from __future__ import annotations

import zmq

from orchestrator.client_wire import daemon_endpoint, worker_socket_said
from orchestrator.deadlines import poll_ms
from orchestrator.rejection import answer_as
from transfer.protocol import (
    CONTROL_REPLY,
    DECODE_ERRORS,
    ControlReply,
    ControlRequest,
    Drain,
    Draining,
    GetStats,
    ListWorkers,
    Stats,
    Workers,
    encode,
)


class Control:
    """Blocking client for the control socket."""

    def __init__(self, endpoint: str, *, timeout_s: float = 10.0, ctx: zmq.Context | None = None) -> None:
        # As the other clients: an endpoint no one can connect to is a ValueError saying why,
        # not ZMQ's "Invalid argument" (``*``) or a wait for a daemon that cannot be there.
        self.endpoint = daemon_endpoint(endpoint)
        self._timeout_s = timeout_s
        self._timeout_ms = poll_ms(timeout_s)  # at most ZMQ's longest poll, 24.8 days
        self._ctx = ctx or zmq.Context.instance()

    def _ask(self, request: ControlRequest) -> ControlReply:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.endpoint)
            sock.send(encode(request))
            if not sock.poll(self._timeout_ms):
                raise TimeoutError(f"no reply from control socket {self.endpoint} "
                                   f"within {self._timeout_s:.1f}s")
            body = sock.recv()
        finally:
            sock.close(linger=0)
        try:
            return CONTROL_REPLY.decode(body)
        except DECODE_ERRORS:
            said = worker_socket_said(body) or "its answer is no control reply"
            raise ValueError(f"{self.endpoint} is not a control socket: {said}") from None

    def stats(self) -> Stats:
        return answer_as(Stats, self._ask(GetStats()), self.endpoint)

    def workers(self) -> Workers:
        return answer_as(Workers, self._ask(ListWorkers()), self.endpoint)

    def drain(self) -> Draining:
        return answer_as(Draining, self._ask(Drain()), self.endpoint)
