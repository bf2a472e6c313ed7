"""Worker connections as the negotiator knows them, and what a registration must satisfy."""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field

import zmq

from orchestrator.config import MOONCAKE_DEFAULT_TIMEOUT_S
from orchestrator.endpoints import is_ip
from transfer.protocol import PROTOCOL_VERSION, LocalMemory, Register, Role, StageLimits


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
    # Its Registered.key, which also names the connection its outputs come on (protocol.md §3.2).
    key: bytes = b""
    local: LocalMemory | None = None  # its pool as shared memory, for senders on its host
    # What its model takes (the door's, and `triptych workers`).
    limits: StageLimits = field(default_factory=StageLimits)
    model_digest: str = ""  # every link's is the same (``model_problem``)
    # Its Register.write_timeout_s: a push of its unreported this long after, plus the
    # bytes' time and the graces (transfer.engine.write_limit_s, PUSH_REPORT_GRACE_S), is
    # stuck. Mooncake's own default until it says.
    write_timeout_s: float = MOONCAKE_DEFAULT_TIMEOUT_S
    reached: bool = False  # its Probed came back: orders sent to its work_address arrive
    # It gets no new work until heard from (a push into it failed, or it went quiet), and
    # none before it is reached.
    suspect: bool = True
    push_failed_at: float | None = None  # a push into it failed then, and it has been silent since
    pushing_late: bool = False  # a push of its is unreported past its due time: its push path is stuck
    stopping: bool = False  # it said Stopping: no new work ever again, whatever it says next
    # Runs of ended requests it is finishing, by the ack of their Abort: each holds a slot
    # of its pool until its Stopped comes back (or the link goes, and its slots with it).
    finishing: dict[int, str] = field(default_factory=dict)

    def holds(self, address: int, nbytes: int) -> bool:
        return self.pool_base <= address and address + nbytes <= self.pool_base + self.pool_size

    def same_worker_as(self, msg: Register) -> bool:
        """Whether ``msg`` comes from this worker, restarted or repeated: same name, session
        or shared pool."""
        return msg.name == self.name or self.same_memory_as(msg)

    def same_memory_as(self, msg: Register) -> bool:
        """Whether ``msg`` advertises this worker's memory: its Mooncake session, which one
        process binds, or its shared pool."""
        return msg.session == self.session or self.shares_memory(msg)

    def shares_memory(self, msg: Register) -> bool:
        """Whether ``msg`` advertises the shared pool this worker registered: one file of one
        kernel (the path differs by process, the file's identity does not)."""
        mine, theirs = self.local, msg.local
        return mine is not None and theirs is not None and (mine.host, mine.device, mine.inode) == (
            theirs.host, theirs.device, theirs.inode)


def registration_problem(msg: Register, token: str, push_quarantine_s: float) -> str | None:
    """Why ``msg`` must be refused (the ``RegisterRefused`` message), or None to accept it."""
    if not hmac.compare_digest(msg.token.encode(), token.encode()):
        return "bad token: this worker's daemon.token is not the daemon's"
    if msg.protocol != PROTOCOL_VERSION:
        return f"protocol {msg.protocol}, daemon speaks {PROTOCOL_VERSION}"
    if msg.write_timeout_s >= push_quarantine_s:
        # Each host's copy of the config says its own; one file is checked as it loads.
        return (f"this worker's Mooncake write timeout ({msg.write_timeout_s:g} s, transfer.env.MC_TRANSFER_TIMEOUT) "
                f"is not below the daemon's push_quarantine_s ({push_quarantine_s:g} s): a write it gave up on "
                "could land in memory already given to another request; lower the one or raise the other")
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


def model_problem(msg: Register, links: Iterable[Link]) -> str | None:
    """Why ``msg``'s model cannot join the registered workers' (``RegisterRefused``), or None.

    Every worker of one daemon serves one model: the first to register sets it, for as
    long as any worker is registered. A worker re-registering under its own name (a
    restart) is compared with the others only.
    """
    serving = next((link for link in links if link.name != msg.name), None)
    if serving is None or serving.model_digest == msg.model_digest:
        return None
    return (f"this worker's model {msg.limits.model!r} (digest {msg.model_digest or 'none'}) is not the model "
            f"the registered workers serve, {serving.limits.model!r} (digest {serving.model_digest or 'none'}): every "
            "worker of a daemon must load the same model (family, configs, tiny seed); to change models, "
            "stop every worker first")


def work_address_problem(ctx: zmq.Context, address: str) -> str | None:
    """Why the daemon could not connect a PUSH to ``address`` (``RegisterRefused``), or None.

    ZMQ itself is asked, on a socket closed at once, since its rules (the transports, a host
    needing a port, the length of an ipc path) are its own. Only another process's socket
    can be the work socket, so ``tcp://`` or ``ipc://``.
    """
    if not address.startswith(("tcp://", "ipc://")):
        return f"work_address {address!r} is not tcp:// or ipc://"
    host, colon, _ = address.removeprefix("tcp://").rpartition(":")
    if address.startswith("tcp://") and colon and not is_ip(host.removeprefix("[").removesuffix("]")):
        # ZMQ would look the name up on its I/O thread, with a blocking call, and again at
        # every reconnect: a slow DNS server would stall every socket of the daemon.
        return (f"work_address {address!r} names its host: the daemon dials only IP addresses "
                "(workers resolve their advertise_host before registering)")
    try:
        probe = zmq.Socket(ctx, zmq.PUSH)
    except zmq.ZMQError as exc:  # out of sockets or file descriptors: the daemon's, not the address's
        return f"the daemon cannot open a socket to check work_address {address!r}: {exc.strerror}"
    try:
        probe.connect(address)
    except zmq.ZMQError as exc:
        return f"work_address {address!r}: {exc.strerror}"
    finally:
        probe.close(linger=0)
    return None
