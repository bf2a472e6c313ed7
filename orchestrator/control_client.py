"""``Control``: the blocking client of the daemon's control socket (stats, workers, drain).

Its own module, free of torch like ``Rejection``: the commands an operator types
(``triptych stats``, ``workers``, ``drain``) and the Prometheus exporter, which runs beside
the daemon for good, only ever read numbers, and torch would cost each about 2.5 s of CPU
to start and 190 MiB to keep.
"""

from __future__ import annotations

import zmq

from orchestrator.client_wire import blocking_context, daemon_endpoint, worker_socket_said
from orchestrator.connection_watch import exchange, watched_req
from orchestrator.deadlines import checked_s
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
        self._timeout_s = checked_s(timeout_s)
        self._ctx = blocking_context(ctx)

    def _ask(self, request: ControlRequest) -> ControlReply:
        # As the other clients: ConnectionError once no daemon took a connection within 3 s,
        # or the one the request went by closed; TimeoutError past timeout_s.
        sock, watch = watched_req(self._ctx, self.endpoint)
        try:
            body = exchange(sock, watch, [encode(request)], self._timeout_s, self.endpoint,
                            f" to a control request ({type(request).__name__})")[0]
        finally:
            watch.close()
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
