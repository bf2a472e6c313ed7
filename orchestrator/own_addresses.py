"""A worker's own addresses, checked as it starts: the host the daemon dials for its work
socket (``advertise_host``) and the one its peers write to (``transfer.local_hostname``).

Each is taken wrong silently by the sockets themselves: a work socket bound where its
advertised address does not lead only shows as orders that never arrive, and Mooncake
starts on any name and fails every write made to it, for as long as the worker runs. So
both are resolved here to IPv4 addresses (no socket of the daemon's turns ZMQ's IPv6 on):
``local_hostname`` must be one of this host's, and a ``bind_host`` given as an address
must be where ``advertise_host`` leads when that is this host's (a NAT's is taken as is).
"""

from __future__ import annotations

import ipaddress
import socket
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as LookupTimedOut

from orchestrator.config import TransferConfig, WorkerConfig
from orchestrator.endpoints import WILDCARD_HOSTS, is_ip
from transfer.binding import EndpointUnusable

# How long a worker's start waits for a name to resolve.
LOOKUP_TIMEOUT_S = 10.0


def dialable(host: str, key: str = "advertise_host", timeout_s: float = LOOKUP_TIMEOUT_S) -> str:
    """``host`` as an IPv4 address, looked up here if it is a name; ``key`` names the setting.

    The daemon dials only IP addresses: ZMQ would look a name up on the daemon's I/O thread,
    with a blocking call, and again at every reconnect, so one slow DNS server would stall
    every socket of the daemon.
    """
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        if address.version != 4:
            raise EndpointUnusable(f"{key} {host!r} is an IPv6 address: give this host's IPv4 address")
        return str(address)
    lookup = ThreadPoolExecutor(max_workers=1, thread_name_prefix="own-address-lookup")
    try:
        infos = lookup.submit(socket.getaddrinfo, host, None, family=socket.AF_INET,
                              type=socket.SOCK_STREAM).result(timeout=timeout_s)
    except LookupTimedOut:
        raise EndpointUnusable(f"{key} {host!r} did not resolve within {timeout_s:g} s") from None
    except OSError as exc:
        raise EndpointUnusable(f"{key} {host!r} does not resolve to an IPv4 address: {exc}") from exc
    finally:
        lookup.shutdown(wait=False)  # a lookup that timed out ends on its own
    return str(infos[0][4][0])


def is_this_hosts(ip: str) -> bool:
    """Whether ``ip`` is an address of one of this host's interfaces (it can be bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((ip, 0))
        except OSError:
            return False
    return True


def check_own_addresses(role: str, wcfg: WorkerConfig, transfer: TransferConfig) -> None:
    """``EndpointUnusable`` naming the setting, for an address of this worker's that its
    daemon or its peers could not reach it at."""
    key = "transfer.local_hostname"
    peers_write_to = dialable(transfer.local_host, key)
    if ipaddress.ip_address(peers_write_to).is_unspecified:  # binds, so is_this_hosts takes it
        raise EndpointUnusable(f"{key} ({transfer.local_hostname}) is a wildcard, which peers cannot write to: "
                               "give this host's address")
    if not is_this_hosts(peers_write_to):
        raise EndpointUnusable(f"{key} ({transfer.local_hostname}) is not an address of this host: "
                               f"every write its peers made to {peers_write_to} would fail")
    if wcfg.work_socket != "tcp":
        return
    dialed = dialable(wcfg.advertise_host)
    if ipaddress.ip_address(peers_write_to).is_loopback and not ipaddress.ip_address(dialed).is_loopback:
        raise EndpointUnusable(f"{key} ({transfer.local_hostname}) is a loopback address while workers.{role}."
                               f"advertise_host ({wcfg.advertise_host}) is not: peers on other hosts could not "
                               "write to this worker; give this host's address on the network they share")
    if wcfg.bind_host in WILDCARD_HOSTS or not is_ip(wcfg.bind_host):
        return  # every interface, or one named (which ZMQ binds as its address)
    if dialed != wcfg.bind_host and is_this_hosts(dialed):
        raise EndpointUnusable(f"workers.{role}.bind_host ({wcfg.bind_host}) is not where advertise_host "
                               f"({wcfg.advertise_host}) leads: the daemon would dial {dialed}, where the work "
                               f"socket does not listen; bind {dialed} or 0.0.0.0")
