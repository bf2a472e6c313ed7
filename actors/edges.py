"""Binding the daemon's sockets: an endpoint in use is an error, never silently taken over."""

from __future__ import annotations

import socket

import zmq


class EndpointInUse(OSError):
    pass


def bind_exclusive(sock: zmq.Socket, endpoint: str) -> str:
    """Bind ``endpoint`` and return the bound address (with the real port for ``:0``/``*``).

    TCP refuses a taken port by itself (EADDRINUSE). An ``ipc://`` path does not: ZMQ
    unlinks the file and binds anew, stealing the endpoint from a daemon still running
    there. So a live listener on the path is detected first and refused.
    """
    if endpoint.startswith("ipc://"):
        path = endpoint.removeprefix("ipc://")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            pass  # nothing listening: a stale file or no file, safe to bind
        else:
            raise EndpointInUse(f"Address already in use: {endpoint} has a live listener")
        finally:
            probe.close()
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
