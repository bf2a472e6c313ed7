"""A worker's own addresses, checked as it starts: wrong ones are refused in one line
naming the setting, where the sockets themselves would take them silently."""

from __future__ import annotations

import socket
import time

import pytest

from orchestrator.config import TransferConfig, WorkerConfig
from orchestrator.own_addresses import check_own_addresses, dialable
from transfer.binding import EndpointUnusable

NOT_HERE = "192.0.2.1"  # a documentation-only address: no host has it


def test_an_advertise_host_that_does_not_resolve_stops_the_start_naming_it() -> None:
    with pytest.raises(EndpointUnusable, match=r"advertise_host 'no-such-host\.invalid' does not resolve"):
        dialable("no-such-host.invalid")


def test_a_lookup_that_hangs_stops_the_start_within_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: time.sleep(5))  # a DNS server that never answers
    started = time.monotonic()
    with pytest.raises(EndpointUnusable, match=r"advertise_host 'gpu-7' did not resolve within 0.2 s"):
        dialable("gpu-7", timeout_s=0.2)
    assert time.monotonic() - started < 2


def test_a_name_with_ipv6_and_ipv4_addresses_is_dialed_at_its_ipv4_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """No daemon socket turns ZMQ's IPv6 on: a name's AAAA record listed first was
    registered, and the worker refused after 2.5 s for an unreachable advertise_host."""
    a = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.5", 0))
    aaaa = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("2001:db8::5", 0, 0, 0))
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port, family=0, **kwargs:
                        [a] if family == socket.AF_INET else [aaaa, a])
    assert dialable("dual.example") == "10.0.0.5"


def test_an_ipv6_address_is_refused_naming_the_setting() -> None:
    with pytest.raises(EndpointUnusable, match=r"transfer.local_hostname '::1' is an IPv6 address"):
        dialable("::1", "transfer.local_hostname")


@pytest.mark.parametrize(("local_hostname", "says"), [
    ("no-such-host.invalid", r"transfer.local_hostname 'no-such-host.invalid' does not resolve"),
    (NOT_HERE, rf"transfer.local_hostname \({NOT_HERE}\) is not an address of this host: every write its peers "
               rf"made to {NOT_HERE} would fail"),
    (f"{NOT_HERE}:15000", rf"transfer.local_hostname \({NOT_HERE}:15000\) is not an address of this host"),
    ("0.0.0.0", r"transfer.local_hostname \(0.0.0.0\) is a wildcard, which peers cannot write to"),
])
def test_a_local_hostname_peers_cannot_write_to_is_refused(local_hostname: str, says: str) -> None:
    """Mooncake starts on any name and fails every write made to it: a decoder registered
    so failed every request it was sent, for as long as it ran."""
    with pytest.raises(EndpointUnusable, match=says):
        check_own_addresses("decoder", WorkerConfig(), TransferConfig(local_hostname=local_hostname))


def test_a_loopback_local_hostname_beside_a_network_advertise_host_is_refused() -> None:
    """The default left in a copy made for another host: the daemon reaches the worker,
    its peers on other hosts never do."""
    wcfg = WorkerConfig(bind_host="0.0.0.0", advertise_host=NOT_HERE)
    with pytest.raises(EndpointUnusable, match=rf"transfer.local_hostname \(127.0.0.1\) is a loopback address while "
                                               rf"workers.denoiser.advertise_host \({NOT_HERE}\) is not"):
        check_own_addresses("denoiser", wcfg, TransferConfig(local_hostname="127.0.0.1"))


def test_a_bind_host_that_is_not_where_the_advertise_host_leads_is_refused() -> None:
    """The work socket bound on 127.0.0.1 (the default) while advertised at another address
    of this host: the daemon's orders never arrive. It was blamed on advertise_host."""
    wcfg = WorkerConfig(bind_host="127.0.0.1", advertise_host="127.0.0.2")
    with pytest.raises(EndpointUnusable, match=r"workers.encoder.bind_host \(127.0.0.1\) is not where advertise_host "
                                               r"\(127.0.0.2\) leads: .* bind 127.0.0.2 or 0.0.0.0"):
        check_own_addresses("encoder", wcfg, TransferConfig())


@pytest.mark.parametrize("wcfg", [
    WorkerConfig(),
    WorkerConfig(bind_host="0.0.0.0", advertise_host="127.0.0.2"),
    WorkerConfig(bind_host="127.0.0.2", advertise_host="localhost.", work_socket="ipc"),  # ipc: neither is used
    WorkerConfig(bind_host="127.0.0.2", advertise_host="127.0.0.2"),
], ids=["defaults", "every interface", "ipc", "the same address"])
def test_addresses_that_lead_to_the_worker_pass(wcfg: WorkerConfig) -> None:
    check_own_addresses("decoder", wcfg, TransferConfig(local_hostname="127.0.0.1"))
