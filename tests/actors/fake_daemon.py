"""A fake daemon for the clients' tests: a ROUTER bound where the daemon's client socket would
be, and the test plays the daemon on it (for the asyncio clients on a ``zmq.asyncio`` context,
for the blocking ones on a plain context)."""

from __future__ import annotations

import zmq
import zmq.asyncio

from transfer.protocol import Reason, RegisterRefused, Rejected

# What the daemon's other sockets answer a client's message with.
WORKER_SOCKETS_REFUSAL = RegisterRefused(message="this is the daemon's worker socket; clients and control commands "
                                                 "have endpoints of their own")
CONTROL_SOCKETS_REFUSAL = Rejected(request_id="", reason=Reason.INVALID, message="this is the daemon's control socket; "
                                   "this message goes to its client socket (daemon.client_endpoint)")
CLIENT_SOCKETS_REFUSAL = Rejected(request_id="", reason=Reason.INVALID, message="this is the daemon's client socket; "
                                  "this message goes to its control socket (daemon.control_endpoint)")


def router_at(ctx: zmq.Context | zmq.asyncio.Context, endpoint: str) -> zmq.Socket:
    """A ROUTER bound at ``endpoint`` on ``ctx``, closed without lingering."""
    daemon = ctx.socket(zmq.ROUTER)
    daemon.setsockopt(zmq.LINGER, 0)
    daemon.bind(endpoint)
    return daemon
