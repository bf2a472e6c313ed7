"""Worker connections as the negotiator knows them, and what a registration must satisfy."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

import zmq

from transfer.protocol import PROTOCOL_VERSION, LocalMemory, Register, Role


@dataclass(slots=True)
class Link:
    """A registered worker connection."""

    routing_id: bytes
    instance: str
    role: Role
    name: str
    session: str
    pool_base: int
    pool_size: int
    work_address: str
    joined_at: float
    last_seen: float
    local: LocalMemory | None = None  # its pool as shared memory, for senders on its host
    reached: bool = False  # its Probed came back: orders sent to its work_address arrive
    # It gets no new work until heard from (a push into it failed, or it went quiet), and
    # none before it is reached.
    suspect: bool = True
    push_failed_at: float | None = None  # a push into it failed then, and it has been silent since

    def holds(self, address: int, nbytes: int) -> bool:
        return self.pool_base <= address and address + nbytes <= self.pool_base + self.pool_size


def registration_problem(msg: Register, token: str) -> str | None:
    """Why ``msg`` must be refused (the ``RegisterRefused`` message), or None to accept it."""
    if not hmac.compare_digest(msg.token.encode(), token.encode()):
        return "bad token"
    if msg.protocol != PROTOCOL_VERSION:
        return f"protocol {msg.protocol}, daemon speaks {PROTOCOL_VERSION}"
    outside = [s.slot_id for s in msg.slots
               if not msg.pool_base <= s.address <= msg.pool_base + msg.pool_size - s.size]
    if outside:
        return f"slots {outside} lie outside the registered pool"
    spans = sorted((s.address, s.address + s.size) for s in msg.slots)
    if len({s.slot_id for s in msg.slots}) != len(msg.slots) or any(
        end > start for (_, end), (start, _) in zip(spans, spans[1:], strict=False)
    ):
        return "slot ids repeat or slots overlap"
    if msg.local is not None and (msg.local.base, msg.local.size) != (msg.pool_base, msg.pool_size):
        return "the shared memory it advertises is not its registered pool"
    return None


def work_address_problem(ctx: zmq.Context, address: str) -> str | None:
    """Why the daemon could not connect a PUSH to ``address`` (``RegisterRefused``), or None.

    ZMQ itself is asked, on a socket closed at once, since its rules (the transports, a host
    needing a port, the length of an ipc path) are its own. Only another process's socket
    can be the work socket, so ``tcp://`` or ``ipc://``.
    """
    if not address.startswith(("tcp://", "ipc://")):
        return f"work_address {address!r} is not tcp:// or ipc://"
    probe = zmq.Socket(ctx, zmq.PUSH)
    try:
        probe.connect(address)
    except zmq.ZMQError as exc:
        return f"work_address {address!r}: {exc.strerror}"
    finally:
        probe.close(linger=0)
    return None
