"""Endpoints: which ZMQ addresses the daemon can bind and its peers can dial, and which of
them other hosts can reach. Checked where a config loads and where a command line names one,
so a bad address is refused with its reason instead of failing at a bind or hanging a dial.
"""

from __future__ import annotations

import ipaddress
import re

# What the daemon binds and its peers dial from other processes: tcp://host:port (an IPv4
# address, a host or interface name, or *; the port a number or * for any) or ipc://path.
# No IPv6: no socket here turns on ZMQ_IPV6, so such an endpoint would fail at its bind.
_ENDPOINT = re.compile(r"tcp://[^\s:\[\]/]+:([0-9]+|\*)|ipc://(\S+)")
# The longest path a Unix socket's address holds (sun_path, less its NUL), on Linux.
MAX_IPC_PATH_BYTES = 107


WILDCARD_HOSTS = frozenset({"0.0.0.0", "*", "::"})


def endpoint_problem(endpoint: str) -> str | None:
    """Why ``endpoint`` cannot be bound by the daemon (caught at load, naming its key), or None."""
    if endpoint.startswith("tcp://["):
        return "an IPv6 endpoint, which Triptych's sockets do not enable: give an IPv4 address or a host name"
    if (match := _ENDPOINT.fullmatch(endpoint)) is None:
        return "not tcp://host:port or ipc://path"
    port, path = match.groups()
    if port is not None and port != "*" and not 1 <= int(port) <= 65535:
        # ZMQ would bind port 0 and one past 65535 to a random port, where no peer looks.
        return f"port {port}, not 1-65535 (or * for any)"
    if path is not None and len(path.encode()) > MAX_IPC_PATH_BYTES:
        return (f"an ipc path of {len(path.encode())} bytes, past the {MAX_IPC_PATH_BYTES} a Unix socket's "
                "address holds: give a shorter one")
    return None


def dial_problem(endpoint: str) -> str | None:
    """Why a peer (a worker, a client, a command) cannot connect to ``endpoint``, or None:
    the daemon may bind ``*`` for any interface or port, which ZMQ cannot connect to.
    (0.0.0.0 it can, on Linux: it reaches this host.)"""
    if (problem := endpoint_problem(endpoint)) is not None:
        return problem
    if endpoint.startswith("tcp://"):
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        if "*" in (host, port):
            return "an address for the daemon to bind, not one to connect to: name the daemon's host and port"
    if endpoint == "ipc://*":
        return "an address for the daemon to bind (a path of ZMQ's choosing), not one to connect to: name the path"
    return None


_LOOPBACK_NAMES = {"localhost": "127.0.0.1"}


def same_address(a: str, b: str) -> bool:
    """Whether binding ``a`` and ``b`` would take one address: the same endpoint however its
    host is spelt (localhost is 127.0.0.1), or one port on a wildcard host and any other.
    (Each "any port" or "any path" endpoint binds one of its own.)"""
    if a.endswith("*") or b.endswith("*"):
        return False
    if not (a.startswith("tcp://") and b.startswith("tcp://")):
        return a == b
    (host_a, port_a), (host_b, port_b) = (e.removeprefix("tcp://").rsplit(":", 1) for e in (a, b))
    host_a, host_b = (_LOOPBACK_NAMES.get(h, h) for h in (host_a, host_b))
    return port_a == port_b and (host_a == host_b or not WILDCARD_HOSTS.isdisjoint({host_a, host_b}))


def is_ip(host: str) -> bool:
    """Whether ``host`` is an IP address, not a name (which would need looking up)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def listens_beyond_this_host(endpoint: str) -> bool:
    """Whether a ZMQ bind endpoint is reachable from other hosts: tcp on anything but a
    loopback address (a wildcard, an interface or host name counts as reachable)."""
    if not endpoint.startswith("tcp://"):
        return False  # ipc:// (file permissions guard it), inproc://
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True
